"""Agent programs run as black boxes: each under a supervisor that owns its deadline and leaves
nothing running, by default in a loopback-only network jail, optionally with an audit of the
connections it tried.

``program``    one program run: spawn under its supervisor, output capture, timeout backstops
``supervise``  the supervisor script (standard library only): deadline, cleanup of the program's
               whole process tree, the in-jail end of the gateway relay
``jail``       the loopback-only network jail (bubblewrap) and the host end of the gateway relay
``netaudit``   the destinations a program tried to reach (``strace``), read back into a short report
"""
