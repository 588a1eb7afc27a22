"""Where the model runs when one process is not enough: worker processes, one per rank."""
