"""Benchmark (not a test): a 10,000-task layered workflow, from submission to the last task done.

Layers of no-op handler tasks; every task of a layer needs two tasks of the layer before. The
whole workflow is one message. Prints the wall time and the scheduler's overhead per task
(wall time x slots / tasks: the slot-time each no-op task cost, which is all overhead).
Run: PYTHONPATH=. .venv/bin/python bench/dag.py [--layers 100] [--width 100] [--runs 1]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from typing import Any

from bench.throughput import Stack
from shared.client import SkedClient
from shared.dag import WorkflowSpec


def layered(layers: int, width: int, rnd: random.Random) -> dict[str, Any]:
    tasks: list[dict[str, Any]] = []
    for layer in range(layers):
        for i in range(width):
            task: dict[str, Any] = {"name": f"l{layer}-{i}", "handler": "bench.jobs:noop"}
            if layer:
                task["needs"] = [f"l{layer - 1}-{j}" for j in rnd.sample(range(width), 2)]
            tasks.append(task)
    return {"name": f"layered-{layers}x{width}", "tasks": tasks}


async def main(args: argparse.Namespace) -> None:
    import os

    os.environ.setdefault("SKED_MAX_MESSAGE_BYTES", str(64 * 1024 * 1024))
    walls = []
    for run in range(args.runs):
        spec = WorkflowSpec.parse(layered(args.layers, args.width, random.Random(run)))
        async with Stack(args) as settings:
            client = SkedClient(settings)
            start = time.perf_counter()
            workflow_id = await client.submit_workflow(spec)
            view = await client.wait_workflow(workflow_id, timeout=1800)
            wall = time.perf_counter() - start
            await client.close()
        n = len(spec.tasks)
        assert view.status() == "succeeded", view.counts()
        walls.append(wall)
        slots = args.executors * args.slots
        print(
            f"run {run + 1}: {n} tasks in {args.layers} layers: {wall:.1f} s, "
            f"{n / wall:,.0f} tasks/s; overhead {wall * slots / n * 1000:.1f} ms of slot time "
            f"per task, {wall / n * 1000:.2f} ms of wall time per task",
            flush=True,
        )
    print(f"median of {args.runs}: {statistics.median(walls):.1f} s for {n} tasks")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, default=100)
    parser.add_argument("--width", type=int, default=100)
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--executors", type=int, default=2)
    parser.add_argument("--slots", type=int, default=16)
    asyncio.run(main(parser.parse_args()))
