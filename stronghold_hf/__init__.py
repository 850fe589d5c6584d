"""stronghold_hf: STRONGHOLD-style working-window offloading and CPU Adam for Hugging Face models.

Public surface only; see docs/ for the user guide and docs/design.md for how it works.
"""

from .config import StrongholdConfig
from .optim import CPUAdam
from .optim.hybrid import StrongholdOptimizer
from .scaler import DynamicLossScaler
from .window import WindowEngine, offload_model
from .integrations.arguments import StrongholdSeq2SeqTrainingArguments, StrongholdTrainingArguments
from .integrations.trainer import StrongholdSeq2SeqTrainer, StrongholdTrainer

__all__ = [
    "StrongholdConfig",
    "CPUAdam",
    "StrongholdOptimizer",
    "DynamicLossScaler",
    "offload_model",
    "WindowEngine",
    "StrongholdTrainingArguments",
    "StrongholdSeq2SeqTrainingArguments",
    "StrongholdTrainer",
    "StrongholdSeq2SeqTrainer",
]
__version__ = "0.1.0"
