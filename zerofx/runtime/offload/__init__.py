"""ZeRO-Offload / ZeRO-Infinity at run time: optimizer-state records, stage-3 parameter shards
and stage-2/3 gradient shards on the device, in host memory or in files on NVMe, stepped and fetched through bounded
windows with the I/O overlapped, from the typed options ``parse_config`` builds
(``zerofx.config.offload_options``). One job per module, listed bottom layer first:

- ``files``: the NVMe tier's files and aligned buffers (NOTE [NVMe I/O]);
- ``tiers``: the tier backends the stores keep records through and the stores' I/O lifecycle
  (NOTE [Tier backends]); a new tier adds its backend here;
- ``store``: the optimizer-state records and their NVMe window (``OffloadStore``);
- ``copies``: host <-> device copies on a CUDA side stream (``HostCopies``);
- ``grads``: the stage-2/3 gradient store (``GradStore``) and the view the step reads it through;
- ``optimizer``: ``OffloadedOptimizer`` and the one-step delayed update;
- ``params``: the stage-3 parameter store (``ParamStore``) and the ``zerofx::fetch_shard`` kernel;
- ``plan``: the offload plans the engine and ``zerofx plan`` build from the options.

The modules inside the package import a module (``zerofx.runtime.offload.files``,
``zerofx.config.offload_options``), never this file, which imports them all: the layers contract then
sees each import where it is.
"""

from zerofx.config.offload_options import GradOffloadOptions, OffloadOptions, ParamOffloadOptions
from zerofx.runtime.offload.files import NvmeFiles, OffloadError, measure_nvme_bytes_per_s
from zerofx.runtime.offload.tiers import MemoryTier, TierBackend, open_tier
from zerofx.runtime.offload.store import OffloadStore
from zerofx.runtime.offload.optimizer import OffloadedOptimizer
from zerofx.runtime.offload.params import ParamStore
from zerofx.runtime.offload.grads import GradStore, OffloadedGrads
from zerofx.runtime.offload.plan import ProgramOffload, plan_engine_offload, plan_engine_param_offload, plan_for_program

__all__ = [
    "GradOffloadOptions",
    "GradStore",
    "MemoryTier",
    "NvmeFiles",
    "OffloadError",
    "OffloadOptions",
    "OffloadStore",
    "OffloadedGrads",
    "OffloadedOptimizer",
    "ParamOffloadOptions",
    "ParamStore",
    "ProgramOffload",
    "TierBackend",
    "measure_nvme_bytes_per_s",
    "plan_engine_offload",
    "plan_engine_param_offload",
    "open_tier",
    "plan_for_program",
]
