"""The job's life, apart from moving bytes: how it is launched, who its ranks are, and how it ends.

``launcher`` finds ``mpiexec`` and builds its command line; ``launch`` refuses a job its launcher split into
singletons; ``identity`` is what every rank must share (the same code and version); ``ranks`` maps a
communicator's ranks to the world's; ``watchdog`` ends a job whose collective waits too long or whose rank
finished while others wait (``departures``); ``interrupt`` ends it on Ctrl-C; ``ending`` is how it ends
(``MPI_Abort``, with an exit as the fallback).
"""
