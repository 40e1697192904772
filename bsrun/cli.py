"""bsrun's command line: parse, validate, hand over to the packages. Nothing else here.

`bsrun [OPTIONS] COMMAND...` launches; `bsrun profile|tune|bench ...` are subcommands.
"""

from __future__ import annotations

import dataclasses
import json
import signal
import sys
from pathlib import Path

import click

from bsrun import __version__
from bsrun.config import KNOBS, TUNABLE, TUNED_FILE, job_signature, load_learned, load_tuned, resolve
from bsrun.errors import BsrunError
from bsrun.sched.adaptive import POINT_KNOBS, describe_point
from bsrun.tune.space import SPACE_HELP

CONTEXT = {"help_option_names": ["-h", "--help"]}
LAUNCH_CONTEXT = {**CONTEXT, "allow_interspersed_args": False}


class BsrunGroup(click.Group):
    """A group whose default command is `run`: `bsrun -np 2 python x.py` = `bsrun run ...`."""

    own_options = ("-h", "--help", "--version")  # what the group itself answers

    def parse_args(self, ctx, args):
        if (args or not self.own_options) and (not args or args[0] not in self.commands) \
                and (not args or args[0] not in self.own_options):
            args = ["run", *args]
        return super().parse_args(ctx, args)


class TuneGroup(BsrunGroup):
    """`bsrun tune LAUNCH...` = `bsrun tune run LAUNCH...`; `bsrun tune --help` explains that."""

    own_options = ()


@click.group(cls=BsrunGroup, context_settings=CONTEXT)
@click.version_option(__version__, prog_name="bsrun")
def cli():
    """Run data-parallel PyTorch training with scheduled gradient communication.

    \b
      bsrun -np 4 python train.py ...                  bsrun's own launcher
      bsrun torchrun --nproc-per-node 4 train.py ...   prefix any existing launch
      bsrun horovodrun -np 4 python train.py ...
      bsrun accelerate launch ... / bash run.sh / python main.py   (run as given)
      bsrun COMMAND --help                             run, profile, tune, bench
    """


def launch_options(f):
    """The options every launching command shares (run, profile, tune): one per knob
    (config.KNOBS; its value, unparsed, under the knob's name), then the launch's own."""
    options = [
        click.option("-np", "--nproc", type=int, default=None,
                     help="number of local workers bsrun starts itself (with `python ...`); without it, "
                          "the command runs as given"),
        *(click.option(knob.flag, knob.name, default=None, help=knob.help) for knob in KNOBS),
        click.option("--config", "config_file", type=click.Path(dir_okay=False, path_type=Path),
                     default=None, help="TOML file of knobs (partition = \"4MB\", ...)"),
        click.option("--grace", type=float, default=10.0, show_default=True,
                     help="seconds between SIGTERM and SIGKILL when stopping workers"),
        click.option("--emulate-bandwidth", default=None,
                     help="run each rank on its own emulated host, links shaped to this rate (3gbit); root"),
        click.option("--emulate-latency", default=None, help="one-way latency on the emulated links (100us)"),
    ]
    for option in reversed(options):
        f = option(f)
    return f


def job_of(command, nproc, network, servers: int = 0) -> tuple[str, list[str]]:
    """The job signature of a launch and the hosts it names: the key of its tuned config.

    On an emulated network each rank is a host of its own, at the emulated rate: a config
    tuned at 1 Gbit/s is not the one for loopback. Parameter servers (--arch ps) are hosts
    too: a config tuned for all-reduce is not the one for PS."""
    hosts = ["localhost"]
    link = f"@{network.rate_bps or 'unshaped'}bit/s,{network.latency_s or 0}s" if network is not None else ""
    if network is not None:
        hosts = [f"emulated-{r}{link}" for r in range(nproc or 1)]
    hosts += [f"ps-server-{k}{link}" for k in range(servers)]
    return job_signature(list(command), nproc or 1, hosts), hosts


def tac_profile(order: str) -> Path:
    """The profile TAC orders by (the folder named in tac:DIR, else the newest one), with
    the order computed from it for the workers (its tac-order.json)."""
    from bsrun.profile.command import latest_folder
    from bsrun.profile.tac import write_order

    folder = Path(order.partition(":")[2]) if ":" in order else latest_folder()
    if not (folder / "trace.json").is_file():
        raise BsrunError(f"--order tac needs a profile: no trace.json in {folder}; run `bsrun profile ...` first")
    try:
        write_order(folder)
    except (OSError, ValueError) as e:
        raise BsrunError(f"--order tac cannot use the profile in {folder}: {e}") from None
    return folder.resolve()


def _signature(command, nproc, network, config) -> str:
    """The key of the job's tuned config and learned point; --arch and --servers are part of the job."""
    return job_of(command, nproc, network, config.servers if config.arch == "ps" else 0)[0]


def commit_learned_point(plan) -> None:
    """The point rank 0's adaptation kept in this run, kept for the job's next launch; not
    when the user fixed a knob: that search was not free, and its point would carry the
    value given for one launch into every later one."""
    from bsrun.launch.summary import decider_adaptation, read_last_run
    from bsrun.tune.commit import commit_learned

    adapt = decider_adaptation(read_last_run())
    if not adapt or adapt.get("state") != "settled" or plan.config.fixed_by_user() & set(POINT_KNOBS):
        return
    signature = _signature(plan.command, plan.nproc if plan.kind == "local" else None, plan.network, plan.config)
    commit_learned(signature, adapt["point"], {"decisions": len(adapt["switches"])})


def resolve_launch(command, nproc, config_file, grace, emulate_bandwidth=None, emulate_latency=None,
                   use_tuned=True, **knobs):
    """Flags -> resolved config -> LaunchPlan; every bad value ends here with one line.

    `knobs`: launch_options' value of each knob, by name (None: not given)."""
    from bsrun.launch.plan import NetworkSpec, make_plan

    network = None
    if emulate_bandwidth is not None or emulate_latency is not None:
        from bsrun.launch import netem

        network = NetworkSpec(
            netem.parse_rate(emulate_bandwidth) if emulate_bandwidth is not None else None,
            netem.parse_latency(emulate_latency) if emulate_latency is not None else None)

    flags = {name: None if value is None else str(value) for name, value in knobs.items()}
    config = resolve(flags, config_file)
    tuned, learned = {}, None
    if use_tuned:  # --arch and --servers are part of the job, so they are resolved first
        signature = _signature(command, nproc, network, config)
        tuned, learned = load_tuned(signature), load_learned(signature)
    if tuned:
        config = resolve(flags, config_file, tuned=tuned)
    if config.order.startswith("tac"):
        config.order = f"tac:{tac_profile(config.order)}"
    plan = make_plan(list(command), nproc, config, grace=grace, network=network)
    if learned is not None and config.enabled and config.adapt:
        plan = dataclasses.replace(plan, adapt_start=learned)
        given = sorted(config.fixed_by_user() & set(POINT_KNOBS))
        click.echo(f"bsrun: adapting from the point the last run kept ({describe_point(learned)}, "
                   f"{TUNED_FILE}){', with ' + ' and '.join(given) + ' as given' if given else ''}", err=True)
    if any(s.startswith("tuned") for s in config.sources.values()):
        fixed = ", ".join(f"{n}={getattr(config, n)}" for n, s in config.sources.items() if s.startswith("tuned"))
        click.echo(f"bsrun: using tuned config {fixed} from {TUNED_FILE}", err=True)
    return plan


@cli.command("run", context_settings=LAUNCH_CONTEXT)
@launch_options
@click.option("--dry-run", is_flag=True, help="print the resolved config and the commands, start nothing")
@click.option("--json", "as_json", is_flag=True, help="machine-readable output (dry run and summary)")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def run_command(command, dry_run, as_json, **launch):
    """Launch COMMAND with scheduling (the default command: `bsrun run` = `bsrun`)."""
    plan = resolve_launch(command, **launch)
    if dry_run:
        from bsrun.dry_run import print_dry_run

        print_dry_run(plan, as_json)
        return 0
    from bsrun.launch.agent import launch as run_plan

    code = run_plan(plan)
    if code == 0 and plan.config.enabled and plan.config.adapt:
        commit_learned_point(plan)
    if as_json:
        from bsrun.launch.summary import LAST_RUN

        click.echo(LAST_RUN.read_text())
    return code


def _csv(values: str) -> list[str]:
    return [v.strip() for v in values.split(",") if v.strip()]


@cli.command("bench", context_settings=CONTEXT)
@click.option("--model", "models", default="vgg16", show_default=True,
              help="reference model(s), comma-separated: vgg16, resnet50, transformer")
@click.option("-np", "--nproc", type=int, default=2, show_default=True, help="workers")
@click.option("--bandwidth", "bandwidths", default="none", show_default=True,
              help="emulated link rate(s), comma-separated (1gbit,3gbit); 'none' = unshaped loopback; root")
@click.option("--modes", default="ddp,bsrun,bound", show_default=True,
              help="comma-separated, from ddp, bsrun (adapting), bsrun-fixed (--no-adapt), horovod, "
                   "bsrun-horovod (adapting), bsrun-horovod-fixed, compute, comm, bound (max of compute "
                   "alone and comm alone, per step), "
                   "overlap (both at once in two threads), replay (a profile of bsrun-fixed replayed "
                   "under a perfect schedule, dependencies kept), ps (parameter servers unscheduled) "
                   "and bsrun:ORDER (forward, tic, tac, fifo)")
@click.option("--arch", default="allreduce", show_default=True,
              help="ps: bsrun's modes push to parameter servers (ps: the unscheduled PS baseline)")
@click.option("--servers", type=int, default=1, show_default=True, help="parameter servers with --arch ps")
@click.option("--steps", type=int, default=10, show_default=True, help="timed steps per run")
@click.option("--warmup", type=int, default=3, show_default=True, help="untimed steps first")
@click.option("--repeat", type=int, default=3, show_default=True, help="runs of each mode, alternating")
@click.option("--batch", type=int, default=None, help="per-worker batch (default: the model's)")
@click.option("--json", "json_path", default=None, help="also write the results to this JSON file")
def bench_command(models, nproc, bandwidths, modes, steps, warmup, repeat, batch, json_path, arch, servers):
    """Side-by-side step times of DDP, Horovod, bsrun and the bounds, on an emulated network."""
    from bsrun.bench.runner import run_bench
    from bsrun.console import new_console
    from bsrun.signals import Stopped, StopSignals

    rates = [None if b.lower() == "none" else b for b in _csv(bandwidths)]
    try:
        with StopSignals():  # SIGTERM too unwinds: the running launch stopped, the scratch folder removed
            results = run_bench(_csv(models), nproc, rates, _csv(modes), steps, warmup, repeat, batch,
                                json_path, new_console(), arch, servers)
    except Stopped as e:
        kept = f"; {json_path} keeps the rows finished before it" if json_path else ""
        click.echo(f"bsrun: bench stopped by {signal.Signals(e.signum).name}{kept}", err=True)
        return 128 + e.signum
    return 1 if any(r["failed_repeats"] for r in results) else 0


@cli.group("tune", cls=TuneGroup, context_settings=CONTEXT)
def tune_group():
    """Tuning trials across launches; `bsrun tune --help` for the options."""


@tune_group.command("run", hidden=True, context_settings=LAUNCH_CONTEXT)
@launch_options
@click.option("--trials", type=click.IntRange(min=1), default=9, show_default=True,
              help="search launches (the first runs bsrun's defaults)")
@click.option("--recheck", type=click.IntRange(min=0), default=3, show_default=True,
              help="best configs (defaults among them) launched once more; the fastest again is committed")
@click.option("--steps", type=click.IntRange(min=2), default=10, show_default=True,
              help="timed steps per trial (their median is the trial's step time)")
@click.option("--warmup", type=click.IntRange(min=1), default=3, show_default=True,
              help="steps before timing starts")
@click.option("--space", default=None, help=f"search ranges (log scale), default {SPACE_HELP}")
@click.option("--fresh", is_flag=True, help="start a new journal instead of resuming this job's")
@click.option("--grid", is_flag=True, help="measure a log-spaced grid over the space instead (commits nothing)")
@click.option("--trial-timeout", type=click.FloatRange(min=1), default=600, show_default=True,
              help="seconds a trial may take before it is stopped and recorded as hung")
@click.option("--seed", type=int, default=0, show_default=True, help="seed of the search")
@click.option("--presim", is_flag=True,
              help="profile the job once first; its what-if replay proposes the first points")
@click.option("--json", "as_json", is_flag=True, help="print the result as JSON (progress goes to stderr)")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
@click.pass_context
def tune_run(ctx, command, trials, recheck, steps, warmup, space, fresh, grid, trial_timeout, seed, presim,
             as_json, **launch):
    """Find the best partition and credit for COMMAND with a few real launches, and commit it.

    \b
      bsrun tune [OPTIONS] -np 2 [LAUNCH OPTIONS] python train.py ...
      bsrun tune show            the journals of .bsrun/tune/ as tables

    Each trial launches the job as `bsrun` would, with a candidate config: the workers time
    STEPS steps after WARMUP and then end at the same step. A knob fixed on the command line
    (or by --config or BSRUN_*) is kept and left out of the search. The journal
    .bsrun/tune/<job>.jsonl keeps every trial: the same command resumes. The winner goes to
    .bsrun/tuned.json, and later runs of the same job (command, -np, network) use it.
    """
    from bsrun.console import new_console
    from bsrun.signals import Stopped
    from bsrun.tune import tuner
    from bsrun.tune.journal import TUNE_DIR
    from bsrun.tune.space import parse_space
    from bsrun.tune.trial import TrialSetup

    plan = resolve_launch(command, **launch, use_tuned=False)
    if not plan.config.enabled:
        raise BsrunError("tuning needs scheduling on; --no-schedule (or BSRUN_ENABLE=0) was given")
    fixed = {n: str(getattr(plan.config, n)) for n in sorted(plan.config.fixed_by_user()) if n in TUNABLE}
    fixed = {n: launch[n] if launch.get(n) is not None else v for n, v in fixed.items()}
    search_space = parse_space(space, fixed)
    signature, hosts = job_of(command, launch["nproc"], plan.network, plan.servers)
    setup = TrialSetup(_launch_flags(ctx, launch), list(command), warmup, steps, trial_timeout,
                       launch["grace"], TUNE_DIR / signature)
    job = tuner.Job(signature, list(command), launch["nproc"] or 1, hosts, setup)
    console = new_console(stderr=as_json)  # --json: the result alone on stdout
    try:
        if grid:
            result = tuner.grid(job, search_space, fresh, console)
        else:
            result = tuner.tune(job, search_space, trials, recheck, fresh, seed, console, use_presim=presim)
    except Stopped as e:
        click.echo(f"bsrun: tuning stopped by {signal.Signals(e.signum).name}; the journal "
                   f"{TUNE_DIR / signature}.jsonl keeps every finished trial: run the same command to resume",
                   err=True)
        return 128 + e.signum
    if as_json:
        click.echo(json.dumps(result, indent=2))
    return 0


def _launch_flags(ctx, launch: dict) -> list[str]:
    """The launch options the user gave, as bsrun flags again: each trial launches with them."""
    flags = []
    for param in ctx.command.params:
        value = launch.get(param.name)
        if param.name not in launch or value is None or value == param.default:
            continue
        if param.secondary_opts:
            flags.append(param.opts[0] if value else param.secondary_opts[0])
        else:
            flags += [param.opts[0], str(value)]
    return flags


@tune_group.command("show", context_settings=CONTEXT)
@click.option("--json", "as_json", is_flag=True, help="the journals' records as JSON")
def tune_show(as_json):
    """Print the tuning journals of this folder (.bsrun/tune/) as tables."""
    from bsrun.console import new_console
    from bsrun.tune import tuner

    shown = tuner.show(new_console(stderr=as_json))
    if as_json:
        click.echo(json.dumps(shown, indent=2))
    return 0


@cli.group("profile", cls=TuneGroup, context_settings=CONTEXT)  # as tune: a launch by default
def profile_group():
    """Per-layer timelines of a launch; `bsrun profile --help` for the options."""


@profile_group.command("run", hidden=True, context_settings=LAUNCH_CONTEXT)
@launch_options
@click.option("-o", "--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="folder for trace.json, summary.json, timeline.png (default .bsrun/profile/<time>)")
@click.option("--steps", type=click.IntRange(min=1), default=None,
              help="recorded steps; the job ends after them (default: record until the job ends)")
@click.option("--warmup", type=click.IntRange(min=0), default=2, show_default=True,
              help="optimizer steps before recording starts")
@click.option("--json", "as_json", is_flag=True, help="print the summary as JSON instead of tables")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def profile_run(command, out_dir, steps, warmup, as_json, **launch):
    """Run COMMAND with recording on, then show where each iteration's time went.

    \b
      bsrun profile [-o DIR] [--steps N] [--warmup K] [LAUNCH OPTIONS] -np 2 python train.py ...
      bsrun profile show [DIR]                        analyse a profile again
      bsrun profile whatif [DIR] --partition 1MB --credit 4x   predict another config

    Every rank records forward and backward spans per module, when each gradient is ready,
    each partition's (or, unscheduled, each DDP bucket's) queue and transfer, the updates and
    the step boundaries, on clocks aligned to rank 0. DIR gets one Chrome trace (Perfetto,
    chrome://tracing), summary.json and timeline.png, also when the run is interrupted.
    """
    from bsrun.profile import command as profile

    return profile.run(resolve_launch(command, **launch), out_dir, warmup, steps, as_json)


@profile_group.command("show", context_settings=CONTEXT)
@click.argument("folder", required=False, type=click.Path(file_okay=False, path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="print the summary as JSON instead of tables")
def profile_show(folder, as_json):
    """Analyse the profile in FOLDER again (default: the newest in .bsrun/profile/)."""
    from bsrun.profile import command as profile

    return profile.show(folder, as_json)


@profile_group.command("whatif", context_settings=CONTEXT)
@click.argument("folder", required=False, type=click.Path(file_okay=False, path_type=Path))
@click.option("--partition", default=None, help="partition size to predict (default: the profiled one)")
@click.option("--credit", default=None, help="credit to predict, a size or a multiple (default: the profiled one)")
@click.option("--schedule/--no-schedule", "schedule", default=None,
              help="predict scheduled or plain DDP (default: as profiled)")
@click.option("--json", "as_json", is_flag=True, help="print the prediction as JSON")
def profile_whatif(folder, partition, credit, schedule, as_json):
    """Predict the step time under another config by replaying the profile in FOLDER."""
    from bsrun.profile import command as profile

    return profile.what_if(folder, partition, credit, schedule, as_json)


def main(argv=None) -> None:
    """Entry point: one clear line and exit code 2 for bad input, never a traceback."""
    try:
        code = cli.main(args=argv if argv is not None else sys.argv[1:], prog_name="bsrun",
                        standalone_mode=False)
    except click.exceptions.Exit as e:
        code = e.exit_code
    except click.exceptions.Abort:
        code = 130
    except click.ClickException as e:
        hint = f" (see '{e.ctx.command_path} --help')" if getattr(e, "ctx", None) else ""
        click.echo(f"bsrun: error: {e.format_message()}{hint}", err=True)
        code = e.exit_code
    except BsrunError as e:
        click.echo(f"bsrun: error: {e}", err=True)
        code = e.exit_code
    sys.exit(code or 0)
