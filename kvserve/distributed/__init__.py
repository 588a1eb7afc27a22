"""Process groups and collectives for running one model over several processes."""
