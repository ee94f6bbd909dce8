"""Hugging Face tokenizer of a gdn2 model: its SentencePiece model, used as gdn2 uses it.

Copied into every exported model folder (``AutoTokenizer.from_pretrained(folder,
trust_remote_code=True)``); it needs sentencepiece and nothing from gdn2. Text is encoded without BOS
or EOS, exactly as ``gdn2.tokenizer.Tokenizer.encode`` does (documents are trained on after an EOS).
"""

import os
import shutil
from typing import Optional

import sentencepiece as spm
from transformers import PreTrainedTokenizer

VOCAB_FILES_NAMES = {"vocab_file": "tokenizer.model"}


class GDN2Tokenizer(PreTrainedTokenizer):
    vocab_files_names = VOCAB_FILES_NAMES
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, vocab_file: str, unk_token: str = "<unk>", bos_token: str = "<s>", eos_token: str = "</s>",
                 pad_token: Optional[str] = None, **kwargs) -> None:
        self.vocab_file = vocab_file
        self.sp = spm.SentencePieceProcessor(model_file=vocab_file)
        kwargs.setdefault("clean_up_tokenization_spaces", False)
        super().__init__(unk_token=unk_token, bos_token=bos_token, eos_token=eos_token, pad_token=pad_token,
                         **kwargs)

    @property
    def vocab_size(self) -> int:
        return self.sp.get_piece_size()

    def get_vocab(self) -> dict[str, int]:
        vocab = {self.sp.id_to_piece(i): i for i in range(self.vocab_size)}
        vocab.update(self.added_tokens_encoder)
        return vocab

    def _tokenize(self, text: str, **kwargs) -> list[str]:
        return self.sp.encode(text, out_type=str)

    def _convert_token_to_id(self, token: str) -> int:
        return self.sp.piece_to_id(token)

    def _convert_id_to_token(self, index: int) -> str:
        return self.sp.id_to_piece(index)

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        # special tokens keep their text (SentencePiece decodes them to ""): lm-eval's hf model stops
        # generating at the decoded EOS, and an empty stop string would stop it after one token
        special = set(self.all_special_tokens)
        pieces, run = [], []
        for token in tokens:
            if token in special:
                pieces += [self.sp.decode_pieces(run), token]
                run = []
            else:
                run.append(token)
        return "".join(pieces) + self.sp.decode_pieces(run)

    def save_vocabulary(self, save_directory: str, filename_prefix: Optional[str] = None) -> tuple[str]:
        name = (filename_prefix + "-" if filename_prefix else "") + VOCAB_FILES_NAMES["vocab_file"]
        target = os.path.join(save_directory, name)
        if os.path.abspath(self.vocab_file) != os.path.abspath(target):
            shutil.copyfile(self.vocab_file, target)
        return (target,)
