"""The real server (HTTP, frontend, tokenizer worker, IPC) in front of an ideal engine, to
measure the host overhead of everything but the scheduler and the model.

The scheduler process is replaced by a stand-in that admits every request at once and every
``--step-ms`` gives one token to every live request (a new request gets its first token at
the next step). With this server, client TTFT minus one step is what the front end costs::

    python benchmark/online/ideal_engine.py --model DIR --port 31001 --step-ms 20 &
    python benchmark/online/bench_serving.py --base-url http://127.0.0.1:31001 \\
        --dataset shared-prefix --gsp-num-groups 16 --gsp-prompts-per-group 32 \\
        --gsp-system-prompt-len 2000 --gsp-question-len 100 --gsp-output-len 64 --vocab-size 4096

Every other argument goes to ``python -m minisgl`` (``--model`` gives the tokenizer).
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

STEP_ENV = "MINISGL_IDEAL_STEP_MS"


def run_ideal_scheduler(args: Any, report_queue: Any) -> None:
    """Spawn target replacing minisgl.server.scheduler_process.run_scheduler."""
    from minisgl.ipc.child import run_child, setup_child

    setup_child(args.log_level)
    run_child(lambda: _serve(args, report_queue))


def _serve(args: Any, report_queue: Any) -> None:
    import zmq

    from minisgl.ipc import sockets
    from minisgl.ipc.child import parent_alive, startup_report
    from minisgl.ipc.messages import (
        AbortRequests,
        AddRequests,
        ControlReply,
        ControlRequest,
        StepOutputs,
        TokenOutput,
    )

    step_s = float(os.environ.get(STEP_ENV, "20")) / 1000
    with startup_report(f"scheduler-tp{args.tp_rank}", report_queue) as ready:
        ctx = zmq.Context()
        inbox = sockets.bind_pull(ctx, args.addresses.scheduler)
        outbox = sockets.connect_push(ctx, args.addresses.worker)
        ready(
            {"context_length": 1 << 20, "vocab_size": 1 << 20, "num_pages": 1 << 20,
             "page_size": 1, "model_path": "ideal", "device": "cpu"}
        )  # fmt: skip
    live: dict[int, list[int]] = {}  # rid -> [prompt tokens, generated, max_tokens]
    next_step = time.perf_counter() + step_s
    while True:
        wait_ms = max(0, int((next_step - time.perf_counter()) * 1000)) if live else 500
        msgs = sockets.recv_all(inbox, wait_ms)
        if not msgs and not live and not parent_alive(args.parent_pid):
            return
        outs: list[TokenOutput] = []
        for msg in msgs:
            if isinstance(msg, AddRequests):
                for r in msg.reqs:
                    live[r.rid] = [len(r.input_ids), 0, r.params.max_tokens or 16]
            elif isinstance(msg, AbortRequests):
                for rid in msg.rids:
                    if (state := live.pop(rid, None)) is not None:
                        outs.append(TokenOutput(rid, [], state[0], state[1], 0, "abort"))
            elif isinstance(msg, ControlRequest):
                stats = {"running": len(live), "waiting": 0, "free_pages": 1 << 20,
                         "evictable_pages": 0, "total_pages": 1 << 20, "page_size": 1,
                         "prefix_hit_rate": 0.0}  # fmt: skip
                sockets.send(outbox, ControlReply(msg.cid, True, stats))
        now = time.perf_counter()
        if not live:
            next_step = now + step_s
        elif now >= next_step:
            next_step = now + step_s
            for rid, state in list(live.items()):
                state[1] += 1
                done = state[1] >= state[2]
                token = 100 + state[1] % 50
                reason = "length" if done else None
                outs.append(TokenOutput(rid, [token], state[0], state[1], 0, reason))
                if done:
                    del live[rid]
        if outs:
            sockets.send(outbox, StepOutputs(outs))


def main() -> int:
    argv = sys.argv[1:]
    if "--step-ms" in argv:
        i = argv.index("--step-ms")
        os.environ[STEP_ENV] = argv[i + 1]
        del argv[i : i + 2]
    import minisgl.server.scheduler_process as process
    from minisgl.cli import main as minisgl_main

    # Runtime.start looks the target up here; spawn pickles it by module and name.
    process.run_scheduler = run_ideal_scheduler  # type: ignore[assignment]
    return minisgl_main(argv)


if __name__ == "__main__":
    sys.exit(main())
