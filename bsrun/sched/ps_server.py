"""A summation parameter server (`python -m bsrun.sched.ps_server`, started by bsrun).

As BytePS's server: it holds no parameters and runs no optimizer, it sums. One thread per
worker reads that worker's pushes in the order it sent them (header, then bytes); the
pushes of one partition are summed as they come, and once every worker's push of a round
is in, the sum goes back to every worker at once (sends are asynchronous; a waiter thread
finishes them in order and so keeps their buffers alive). The workers divide by their
number, so results are those of an all-reduce.

It waits for pushes without a time limit (a job may pause between steps for as long as it
likes); hangs are the workers' to detect. When a worker goes away the server ends: with 0
if the connection was closed by the peer (the job ended, or a worker failed and bsrun
reports that), otherwise with 1 and the error. bsrun stops servers once the workers exit.
"""

from __future__ import annotations

import os
import queue
import sys
import threading
from datetime import timedelta

import torch

from bsrun.config import PS_RANK_ENV
from bsrun.sched.ps_protocol import HEADER_TAG, Group, data_tag, decode_layout, layout_key

WAIT_FOREVER = timedelta(days=365)
PEER_GONE = ("connection closed by peer", "connection reset", "broken pipe", "socket closed")


class SummationServer:
    def __init__(self, group: Group):
        self.group = group
        self.layouts: dict[int, tuple[int, dict]] = {}  # model -> (its newest generation, that layout)
        self.sums: dict[tuple[int, int], tuple[torch.Tensor, int]] = {}  # (m, pid) -> (sum, pushes)
        self.lock = threading.Lock()
        self.sends: queue.Queue = queue.Queue()
        self.errors: queue.Queue = queue.Queue()

    def layout(self, model: int, generation: int) -> dict:
        """Worker 0 writes a layout before its first push. A new generation replaces the
        one before: every push of that one was read before a worker could send the first
        of the new one (each had pulled every sum of the old layout)."""
        with self.lock:
            known = self.layouts.get(model)
            if known is None or known[0] != generation:
                known = (generation, decode_layout(self.group.store.get(layout_key(model, generation))))
                self.layouts[model] = known
            return known[1]

    def serve_worker(self, worker: int) -> None:
        pg = self.group.pg
        header = torch.empty(3, dtype=torch.int64)
        while True:
            pg.recv([header], worker, HEADER_TAG).wait()
            model, pid, generation = header.tolist()
            layout = self.layout(model, generation)
            data = torch.empty(layout["numel"][pid], dtype=layout["dtype"][pid])
            pg.recv([data], worker, data_tag(model, pid)).wait()
            self.add(model, pid, data)

    def add(self, model: int, pid: int, data: torch.Tensor) -> None:
        with self.lock:
            total, pushes = self.sums.pop((model, pid), (None, 0))
            total = data if total is None else total.add_(data)
            pushes += 1
            if pushes < self.group.workers:
                self.sums[(model, pid)] = (total, pushes)
                return
        tag = data_tag(model, pid)
        for worker in range(self.group.workers):
            self.sends.put((self.group.pg.send([total], worker, tag), total))

    def finish_sends(self) -> None:
        while True:
            work, _buffer = self.sends.get()
            work.wait()

    def run(self) -> int:
        threads = [threading.Thread(target=self._guard, args=(self.serve_worker, w), daemon=True)
                   for w in range(self.group.workers)]
        threads.append(threading.Thread(target=self._guard, args=(self.finish_sends,), daemon=True))
        for t in threads:
            t.start()
        error = self.errors.get()  # the first thread to fail ends the server
        if any(s in str(error).lower() for s in PEER_GONE):
            return 0
        print(f"bsrun: parameter server {self.group.rank - self.group.workers}: {error}", file=sys.stderr, flush=True)
        return 1

    def _guard(self, fn, *args) -> None:
        try:
            fn(*args)
        except BaseException as e:
            self.errors.put(e)


def main() -> int:
    torch.set_num_threads(1)
    group = Group.from_env(int(os.environ[PS_RANK_ENV]), WAIT_FOREVER)
    return SummationServer(group).run()


if __name__ == "__main__":
    code = main()
    sys.stderr.flush()
    os._exit(code)  # not sys.exit: its threads sit in gloo, whose teardown would abort the process
