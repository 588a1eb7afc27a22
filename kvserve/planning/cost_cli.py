"""placeholder"""
def add_cli_args(p): pass
def run_from_args(a): return 0
