"""Entry of `kvserve router`: launch replicas if asked, then serve until stopped."""

from __future__ import annotations

import argparse

from kvserve.router.config import load_config
from kvserve.router.launch import launch_replicas, stop_replicas
from kvserve.router.server import serve, worker_specs


def run_router(args: argparse.Namespace) -> int:
    serve_args = list(args.serve_args or [])
    if serve_args and serve_args[0] == "--":
        serve_args = serve_args[1:]
    if serve_args and not args.launch:
        raise ValueError("arguments after `--` are for --launch N replicas; pass --launch")
    processes, urls = ([], [])
    if args.launch:
        if args.config:
            load_config(args.config)  # a bad file fails before the replicas start
        processes, urls = launch_replicas(args.launch, serve_args, args.launch_base_port)
    try:
        return serve(args, worker_specs(args, urls))
    finally:
        stop_replicas(processes, args.shutdown_timeout)
