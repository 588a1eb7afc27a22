"""`kvserve router`: one OpenAI endpoint in front of many `kvserve serve` replicas.

The router talks HTTP to its workers and imports nothing of the engine, so it starts in a
fraction of a second and runs on any machine that reaches the replicas.
"""
