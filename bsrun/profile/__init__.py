"""`bsrun profile`: per-layer compute and communication timelines, analysis and what-if.

    trace.py     the ranks' recordings (bsrun/inject/record.py) -> one Chrome trace
    analysis.py  the trace -> per-layer and per-iteration figures
    whatif.py    an alpha-beta model of the transfers and a replay: predicted step times
    timeline.py  a Gantt chart of one steady-state iteration (PNG)
    command.py   what the CLI's profile commands do: launch, merge, analyse, print

Nothing here imports torch: the launcher stays light, and the analysis runs anywhere.
"""
