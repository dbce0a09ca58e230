"""Inference engines as the orchestrator drives them.

- :mod:`.engine`: the :class:`InferenceEngine` contract, its memory-region state machine and
  its errors;
- :mod:`.sglang`: :class:`SGLangEngine`, the contract over SGLang's native HTTP admin API;
- :mod:`.reference` (with :mod:`.serving`): the reference engine, a small torch server that
  speaks the same HTTP subset on a CPU (``python -m workers.inference.reference --port N``).

Importing this package does not import torch; only the reference engine needs it.
"""

from .engine import (PAUSE_MODES, REGIONS, EngineCallError, EngineConfigError, EngineError,
                     EngineTimeoutError, EngineUncertainError, Generation, InferenceEngine,
                     MemoryRegions, RegionState, WeightUpdate)
from .sglang import SGLangConfig, SGLangEngine

__all__ = ["PAUSE_MODES", "REGIONS", "EngineCallError", "EngineConfigError", "EngineError",
           "EngineTimeoutError", "EngineUncertainError", "Generation", "InferenceEngine",
           "MemoryRegions", "RegionState", "SGLangConfig", "SGLangEngine", "WeightUpdate"]
