"""Tokenizers (Hugging Face `tokenizers`): BPE by default, WordLevel as the tutorials use.

Special tokens have the same ids everywhere; the model's pad_id is PAD_ID.
"""

from __future__ import annotations

PAD, UNK, BOS, EOS = "[PAD]", "[UNK]", "[BOS]", "[EOS]"
SPECIAL_TOKENS = [PAD, UNK, BOS, EOS]
PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3
