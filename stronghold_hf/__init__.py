"""stronghold_hf: STRONGHOLD-style working-window offloading and CPU Adam for Hugging Face models.

Public surface only; see docs/ for the user guide and docs/design.md for how it works.
"""

from .config import StrongholdConfig
from .integrations.arguments import StrongholdSeq2SeqTrainingArguments, StrongholdTrainingArguments

__all__ = [
    "StrongholdConfig",
    "StrongholdTrainingArguments",
    "StrongholdSeq2SeqTrainingArguments",
]
__version__ = "0.1.0"
