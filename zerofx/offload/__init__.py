"""ZeRO-Offload / ZeRO-Infinity at run time: optimizer-state records, stage-3 parameter shards
and stage-2/3 gradient shards on the device, in host memory or in files on NVMe, stepped and fetched through bounded
windows with the I/O overlapped. One job per module, listed bottom layer first (NOTE [Layers]
in pyproject.toml):

- ``options``: the typed options ``parse_config`` builds (below the config);
- ``files``: the NVMe tier's files and I/O threads (NOTE [NVMe I/O]);
- ``store``: the optimizer-state records and their NVMe window (``OffloadStore``);
- ``copies``: host <-> device copies on a CUDA side stream (``HostCopies``);
- ``grads``: the stage-2/3 gradient store (``GradStore``) and the view the step reads it through;
- ``optimizer``: ``OffloadedOptimizer`` and the one-step delayed update;
- ``params``: the stage-3 parameter store (``ParamStore``) and the ``zerofx::fetch_shard`` kernel;
- ``plan``: the offload plans the engine and ``zerofx plan`` build from the options.

The modules inside the package, and the config below it, import a module (``zerofx.offload.files``,
``zerofx.offload.options``), never this file, which imports them all: the layers contract then
sees each import where it is.
"""

from zerofx.offload.options import GradOffloadOptions, OffloadOptions, ParamOffloadOptions
from zerofx.offload.files import NvmeFiles, OffloadError, measure_nvme_bytes_per_s
from zerofx.offload.store import OffloadStore
from zerofx.offload.optimizer import OffloadedOptimizer
from zerofx.offload.params import ParamStore
from zerofx.offload.grads import GradStore, OffloadedGrads
from zerofx.offload.plan import ProgramOffload, plan_engine_offload, plan_engine_param_offload, plan_for_program

__all__ = [
    "GradOffloadOptions",
    "GradStore",
    "NvmeFiles",
    "OffloadError",
    "OffloadOptions",
    "OffloadStore",
    "OffloadedGrads",
    "OffloadedOptimizer",
    "ParamOffloadOptions",
    "ParamStore",
    "ProgramOffload",
    "measure_nvme_bytes_per_s",
    "plan_engine_offload",
    "plan_engine_param_offload",
    "plan_for_program",
]
