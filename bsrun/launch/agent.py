"""launch(plan): start the workers, watch them, tear down, write the run summary.

The one place that owns a launch from start to exit code, as torchrun's agent does.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

from bsrun.launch import summary
from bsrun.launch.horovod import horovod_installed, rendezvous_for
from bsrun.launch.plan import LaunchPlan
from bsrun.launch.watchdog import Watchdog
from bsrun.launch.workers import GroupResult, WorkerGroup
from bsrun.signals import Stopped, StopSignals


def new_report_dir() -> Path:
    base = Path(".bsrun")
    base.mkdir(exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=".reports-", dir=base)).resolve()


def say(message: str) -> None:
    print(f"bsrun: {message}", file=sys.stderr, flush=True)


def _describe_failure(plan: LaunchPlan, result: GroupResult, reports: dict, watchdog: Watchdog) -> str | None:
    if result.hung_rank is not None:
        return (f"rank {result.hung_rank} stopped responding (no heartbeat for {watchdog.hung[1]:.0f} s, "
                f"--timeout {plan.config.timeout:g}: stuck in native code that holds the Python lock, "
                f"or stopped); the workers were stopped")
    if result.failed_service is not None:
        return f"{result.failed_service} failed with exit code {result.service_code}; the workers were stopped"
    if result.failed_rank is not None:
        if plan.kind != "local":  # the command itself; its workers' errors are in its own output
            errors = [f"rank {r}: {rep['error']}" for r, rep in sorted(reports.items()) if rep.get("error")]
            return (f"'{plan.command[0]}' failed with exit code {result.exit_code}"
                    + (f" ({errors[0]})" if errors else ""))
        why = reports.get(result.failed_rank, {}).get("error")
        return (f"rank {result.failed_rank} failed with exit code {result.exit_code}" + (f" ({why})" if why else "")
                + "; the other workers were stopped")
    if result.interrupted_by is not None:
        return f"stopped by {signal.Signals(result.interrupted_by).name}; all workers were stopped"
    return None


def launch(plan: LaunchPlan) -> int:
    """Run the plan to the end and return bsrun's exit code.

    SIGINT/SIGTERM unwind the set-up (Stopped) until the workers start; then they go to
    the workers, which are stopped and reported."""
    try:
        with StopSignals() as stop:
            if plan.network is None:
                return _launch_on(plan, None, stop)
            from bsrun.launch.netem import EmulatedNetwork

            spec = plan.network
            with EmulatedNetwork(plan.hosts, spec.rate_bps, spec.latency_s) as net:
                if plan.hosts > 1 and spec.rate_bps:
                    achieved = net.measure_rate(seconds=0.5)
                    say(f"emulated network: {plan.hosts} hosts, set {spec.rate_bps / 1e9:.3g} Gbit/s, "
                        f"measured {achieved / 1e9:.3g} Gbit/s")
                return _launch_on(plan, net, stop)
    except Stopped as e:
        say(f"stopped by {signal.Signals(e.signum).name} before the workers started")
        return 128 + e.signum


def _horovod_rendezvous(plan: LaunchPlan, net):
    """Horovod's rendezvous for the workers bsrun starts itself, when Horovod is installed."""
    if plan.kind != "local" or plan.nproc < 2 or not horovod_installed():
        return contextlib.nullcontext()
    return rendezvous_for(plan.nproc, net)


def _launch_on(plan: LaunchPlan, net, stop: StopSignals) -> int:
    plan.report_dir = new_report_dir()
    with _horovod_rendezvous(plan, net) as horovod:
        group = WorkerGroup(plan.worker_specs(net, horovod), grace=plan.grace)
        watchdog = Watchdog(plan.report_dir, plan.config.timeout)
        started = time.time()
        stop.forward_to = group.request_stop
        group.start()
        result = group.wait(watchdog)
    ended = time.time()
    reports = summary.read_rank_reports(plan.report_dir)
    shutil.rmtree(plan.report_dir, ignore_errors=True)
    run = summary.build_summary(plan.command, plan.config, plan.kind, result.exit_code,
                                result.exit_codes, reports, started, ended,
                                {rank: proc.pid for rank, proc in group.procs.items()})
    summary.save_summary(run)
    failure = _describe_failure(plan, result, reports, watchdog)
    if failure:
        say(failure)
    print(summary.one_line(run), file=sys.stderr, flush=True)
    return result.exit_code
