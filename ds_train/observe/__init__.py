"""Watching a run, live and after the fact: metrics sinks (metrics), logs on disk (logs), heartbeats and
the hang watchdog (watchdog, launchers) with this process's memory, OOM kills and I/O (resources),
reports on what the ranks published (reports), and the commands that read a run directory: monitor,
plots, doctor and its fixes (doctor, doctor_fixes).

It may import the bottom (errors, fs, dist, config), the plan package and checkpoint.rundir (a run
directory's layout); nothing of the run machinery, the loops or the CLI.
"""
