"""Online adaptation inside a worker: rank 0's search carried to every rank at a step boundary.

Every WINDOW optimizer steps (bsrun/sched/adaptive.py says which points and why), each
rank calls the model's training-thread agreement (`Transport.agree`, a broadcast of rank
0's values) right after step() returns: rank 0 sends its decision, the others take it. So
every rank switches after the same step, and the switch itself (`ModelRuntime.reconfigure`)
first finishes the round and applies every pending update: parameters are exactly what
they would have been without the switch. Only rank 0's clock and transfers count.
Once a point is kept, the drift checks' agreement is posted without waiting
(`Transport.agree_later`) and carried out one step later, on every rank at that step: a
blocking broadcast after step() would make the faster rank wait there for the slower
one's whole step (its updates included), where the dependency proxy lets it start its
next forward.

Under Join a rank that ran out of inputs stops stepping, so it could not take part in
later agreements: in the first synchronising round with a rank joined every rank carries
out the agreement posted a step before, if any, then one last decision of rank 0's (the
point kept so far), and adaptation stops there (`at_join`). The ranks still training see
the join in the announcement of that round's forward (bsrun/inject/join.py), the joined
rank in its first shadowed round.

Off (said in the run summary, with why): --no-adapt; a tuning trial or a profile, which
measure the point as given, unless --adapt was given; PowerSGD (its state is per bucket;
the other hooks bsrun runs are stateless and elementwise, so a new layout cannot change
what they compute).
"""

from __future__ import annotations

import json
import time
from dataclasses import replace

from bsrun.config import ADAPT_START_ENV, PROFILE_DIR_ENV, TRIAL_OUT_ENV, worker_setting
from bsrun.inject import state
from bsrun.sched.adaptive import (WARMUP_STEPS, WINDOW, Decision, Explorer, Fixed, Point, describe_point,
                                  unscheduled_like)
from bsrun.trace_events import NOTE

_ORDERS = ("configured", "fifo")  # a point's order on the wire: the agreed configured order, or fifo
_KINDS = ("steady", "record", "switch")
_WHYS = ("steady", "explore", "keep", "drift")  # a decision's why, as the other ranks record it


class Adapter:
    """One model's adaptation: a step listener from its first synchronising backward on."""

    def __init__(self, runtime):
        self.runtime = runtime
        self.why_off: str | None = self._why_off(runtime.config)
        self.explorer: Explorer | None = None
        self.switches: list[dict] = []
        self.searching = True  # every rank, from rank 0's decisions
        self.steps = 0         # this model's steps: step() calls after a new synchronising backward
        self.rounds_seen = 0
        self.next_decision = 0
        self.switched_at = 0
        self.boundaries: list[float] = []  # rank 0: step() returns since the last decision
        self.transfers: list[tuple[int, float, float]] | None = None  # (bytes, post, finish) while fitting
        self._posts: dict[int, float] = {}
        self._agreeing = None  # a steady window's (decision, agreement), posted a step ago
        self._joined = None    # under Join: has a rank joined, as of this round's forward
        self.last_step = 0     # the number of the last counted step

    @staticmethod
    def _why_off(config) -> str | None:
        if not config.adapt:
            return "--no-adapt"
        given = config.sources.get("adapt", "default").split(" ")[0] in ("flag", "config", "env")
        if not given and worker_setting(TRIAL_OUT_ENV):
            return "a tuning trial times the point as given"
        if not given and worker_setting(PROFILE_DIR_ENV):
            return "a profile records the point as given (bsrun profile --adapt records the switches)"
        return None

    def stop(self, why: str) -> None:
        """From here on every rank keeps its point (called on every rank at the same place)."""
        if self.why_off is None:
            self.why_off = why
        if self.on_step in state.STEP_LISTENERS:
            state.STEP_LISTENERS.remove(self.on_step)

    def started(self) -> None:
        """The runtime has its first layout (every rank, the same backward pass)."""
        hook = getattr(self.runtime.transport, "reduce", None)  # a DDP comm hook: the torch transport only
        if self.why_off is None and hook is not None and hook.powersgd:
            self.why_off = "PowerSGD keeps state per bucket (error feedback, warm start), which a new layout would lose"
        if self.why_off is not None or self.explorer is not None:
            return
        rt = self.runtime
        config = rt.config
        fixed_by_user = config.fixed_by_user()
        fixed = Fixed(partition=rt.partition_bytes if "partition" in fixed_by_user else None,
                      credit_bytes=rt.credit_bytes if "credit" in fixed_by_user else None,
                      order=config.order.partition(":")[0] if "order" in fixed_by_user else None)
        configured = self.point()
        start = self._learned(fixed)
        if start is not None and start != configured:
            rt.partition_bytes, rt.credit_bytes, rt.order_name, rt.proxy = (
                start.partition, start.credit_bytes, start.order, start.proxy)
        self.explorer = Explorer(self.point(), fixed, others=[configured],
                                 model_bytes=sum(p.nbytes for p in rt.params),
                                 fallback_first=rt.can_run_on_ddp(fixed.apply(unscheduled_like())))
        self.next_decision = WARMUP_STEPS
        state.STEP_LISTENERS.append(self.on_step)

    def _learned(self, fixed: Fixed) -> Point | None:
        """The point an earlier run of this job kept (the launcher passes it), as far as
        the user left it free; every rank reads the same variable."""
        text = worker_setting(ADAPT_START_ENV)
        try:
            learned = Point(**json.loads(text)) if text else None
        except (ValueError, TypeError) as e:
            state.say_once(f"ignoring {ADAPT_START_ENV} ({e}): adapting from the configured point")
            return None
        if learned is not None and learned.order not in ("fifo", self.runtime.configured_order_name):
            learned = replace(learned, order=self.runtime.configured_order_name)
        return fixed.apply(learned) if learned is not None else None

    def point(self) -> Point:
        rt = self.runtime
        return Point(rt.partition_bytes, rt.credit_bytes, rt.order_name, rt.proxy)

    # --- rank 0's measurements ------------------------------------------------------------

    def observer(self, recorder_trace):
        """The scheduler's observer: rank 0 notes (bytes, post, finish) while a fit wants them."""
        posts = self._posts

        def observe(event: str, pid: int, t_ns: int, nbytes: int) -> None:  # the scheduler's threads
            if recorder_trace is not None:
                recorder_trace(event, pid, t_ns, nbytes)
            if self.transfers is None:
                return
            if event == "post":
                posts[pid] = t_ns / 1e9
            elif event == "finish" and pid in posts:
                self.transfers.append((nbytes, posts.pop(pid), t_ns / 1e9))
        return observe

    def on_step(self, number: int) -> None:
        """After optimizer step `number`. Only the first step() after each synchronising
        backward of this model counts (its rounds are collective, so the same on every
        rank); a step of an optimizer no other rank steps cannot shift the decisions."""
        if self.runtime.rounds == self.rounds_seen:
            return
        self.rounds_seen = self.runtime.rounds
        self.steps += 1
        self.last_step = number
        if state.worker_rank() == 0:
            self.boundaries.append(time.perf_counter())
        if self._joined is not None and self._joined():
            self.at_join(number)
            return
        if self._agreeing is not None:  # every rank posted it at the step before this one
            self._carry_out_posted(number)
            return
        if self.steps < self.next_decision:
            return
        decision = self._decide() if state.worker_rank() == 0 else None
        values = self._values(decision)
        if not self.searching:  # every rank alike: `searching` is rank 0's, as agreed
            self._agreeing = (decision, self.runtime.transport.agree_later(values))
            return
        self._carry_out(number, self._agreed(decision, self.runtime.transport.agree(values)))

    def _decide(self) -> Decision:
        if not self.switches:
            return self.explorer.start()
        skip = 2 if self.switched_at and self.switched_at == self.steps - WINDOW else 1
        times = [b - a for a, b in zip(self.boundaries[skip - 1:], self.boundaries[skip:])]
        return self.explorer.window_done(times, self.transfers or [])

    # --- every rank ----------------------------------------------------------------------

    def watch_join(self, joined) -> None:
        """Under Join: `joined()` says, on a rank still training, whether a rank has joined
        as of this round's forward."""
        self._joined = joined

    def at_join(self, number: int) -> None:
        """The first synchronising round with a rank joined, on every rank after it (step
        `number` of a rank still training, a joined rank's shadowed round): the agreement
        posted a step ago carried out, then rank 0's last decision, then no more."""
        if self.why_off is not None or self.explorer is None:
            return
        if self._agreeing is not None:
            self._carry_out_posted(number)
        decision = self.explorer.conclude("a rank ran out of inputs (Join)") if state.worker_rank() == 0 else None
        self._carry_out(number, self._agreed(decision, self.runtime.transport.agree(self._values(decision))))
        self.stop("Join: a rank ran out of inputs, so the ranks keep the point of that round on")

    def _carry_out_posted(self, number: int) -> None:
        """The agreement every rank posted a step before (`agree_later`), taken and carried out."""
        decision, agreement = self._agreeing
        self._agreeing = None
        self._carry_out(number, self._agreed(decision, agreement()))

    def _values(self, decision: Decision | None) -> list[int]:
        """Rank 0's decision as the integers agreement sends (the other ranks' are ignored)."""
        values = [0] * 8
        if decision is not None:
            point = decision.point or self.explorer.current
            kind = "switch" if decision.point is not None else ("steady" if decision.why == "steady" else "record")
            values = [_KINDS.index(kind), point.partition, point.credit_bytes,
                      _ORDERS.index("fifo" if point.order == "fifo" else "configured"), int(point.proxy),
                      int(decision.trace), int((decision.median_s or 0) * 1e9),
                      _WHYS.index(decision.why.split(":")[0])]
        return values

    def _agreed(self, decision: Decision | None, agreed: list[int]) -> tuple[str, Point, bool, str, float | None]:
        """Rank 0's decision on every rank: (kind, point, trace, why, median). The other
        ranks record the why's first word (rank 0's report has the whole sentence)."""
        order = "fifo" if _ORDERS[agreed[3]] == "fifo" else self.runtime.configured_order_name
        point = Point(agreed[1], agreed[2], order, bool(agreed[4]))
        why = decision.why if decision is not None else f"{_WHYS[agreed[7]]} (rank 0's decision)"
        self.searching = _WHYS[agreed[7]] != "keep" if agreed[0] else self.searching
        return _KINDS[agreed[0]], point, bool(agreed[5]), why, agreed[6] / 1e9 if agreed[6] else None

    def _carry_out(self, number: int, agreed) -> None:
        kind, point, trace, why, median = agreed
        rt = self.runtime
        # a learned start at plain DDP's point ran bsrun's rounds (DDP cannot take over a backward under way)
        if kind == "switch" or (rt.can_run_on_ddp(point) and not rt.on_ddp):
            rt.reconfigure(point)
            self.switched_at = self.steps
        if kind != "steady":
            on_ddp = rt.on_ddp
            self.switches.append({"step": number, "point": point.as_dict(), "ddp_reducer": on_ddp,
                                  "why": why, "median_s": median})
            where = " on DDP's own reducer" if on_ddp else ""
            line = f"adapt at step {number}: {'switch to' if kind == 'switch' else 'at'} " \
                   f"{describe_point(point.as_dict())}{where} ({why})"
            state.debug(line)
            if state.recorder is not None and state.worker_rank() == 0:  # a profile's trace shows them too
                state.recorder.meta(NOTE, text=line)
        self._posts.clear()
        self.transfers = [] if trace and state.worker_rank() == 0 else None
        self.boundaries = self.boundaries[-1:]
        self.next_decision = self.steps + WINDOW

    def report(self) -> dict:
        status = "off" if self.why_off is not None else "exploring" if self.searching else "settled"
        return {"state": status, "why_off": self.why_off, "point": self.point().as_dict(),
                "ddp_reducer": self.runtime.on_ddp, "switches": self.switches}
