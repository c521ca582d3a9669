"""How a collective's bytes move: one interface, one file per way, chosen per call in one place (``Router``).

Every transport (``base.Transport``) has ``reduce_scatter``, ``allreduce`` and ``allgather`` of a ``send``
buffer into a ``recv`` buffer (``allgather``'s ``send`` None: in place, ``recv``'s block of this rank already
holding its shard), ``blocking`` or not, and returns a ``Pending`` that ``wait`` completes; ``two_level`` says
whether it sends across nodes in two levels (for the traffic count). ``Collectives`` counts, watches and times
every call and asks ``Router.route`` which transport moves it:

- ``Local`` (``local.py``): a world of one rank: a copy.
- ``HostMPI``, ``CudaAwareMPI`` (``mpi.py``): MPI's own calls on host buffers (large reduce-scatters in
  pieces), or on device buffers where MPI is CUDA-aware, once the current stream has written them.
- ``PinnedStaging``, ``PageableStaging`` (``staged.py``): device buffers through host memory around MPI.
- ``Arena``, ``TwoLevelArena`` (``arena.py``): host buffers summed straight out of a node-shared window, on one
  host or in two levels.

Every transport moves the same bytes into ``recv``, so every choice gives the same bits. A new way for device
buffers (NCCL, say) is one new file here and one row of ``router.DEVICE_TRANSPORTS`` (and ``device_path``, where
it is chosen). Beside the transports: ``staging.py`` (the chunked copies the staged ones use) and ``pieces.py``
(host reduce-scatters in cache-sized pieces, ``HostMPI``'s).
"""

from mpizero.comm.transports.base import Transport
from mpizero.comm.transports.router import Router, device_path
from mpizero.comm.transports.staged import STAGING_ENV_VAR, requested_staging

__all__ = ["STAGING_ENV_VAR", "Router", "Transport", "device_path", "requested_staging"]
