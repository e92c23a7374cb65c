"""Host-side scheduling for ouro-jax: pure Python + numpy, never jax (the runner owns the device).

``Scheduler`` decides what each invocation runs (admission, prefill mode, decode refill, exits);
``BatchDescriptor`` carries it to the runner as one packed int32 buffer padded to a ``BucketSpec``
key (docs/contracts.md).
"""

from .block_manager import DEFAULT_ENABLE_PREFIX_CACHING, KVBlockManager, prefix_block_hashes
from .buckets import BucketKey, BucketSpec
from .descriptor import BatchDescriptor, StackedDescriptor, StepResult, build_descriptor, descriptor_layout
from .plan import BatchPlan, CodaRow, Phase, ScheduledRange
from .policies import MixedPolicy, SplitPolicy, WaitingQueue, WavefrontPolicy
from .request import Request, RequestStatus
from .sampling_params import SamplingParams
from .scheduler import RequestDelta, Scheduler, SchedulerConfig

__all__ = [
    "DEFAULT_ENABLE_PREFIX_CACHING",
    "KVBlockManager",
    "prefix_block_hashes",
    "BucketKey",
    "BucketSpec",
    "BatchDescriptor",
    "StackedDescriptor",
    "StepResult",
    "build_descriptor",
    "descriptor_layout",
    "BatchPlan",
    "CodaRow",
    "Phase",
    "ScheduledRange",
    "MixedPolicy",
    "SplitPolicy",
    "WaitingQueue",
    "WavefrontPolicy",
    "Request",
    "RequestStatus",
    "SamplingParams",
    "RequestDelta",
    "Scheduler",
    "SchedulerConfig",
]
