"""Hot prefixes (prefill_templates.yaml) are tokenized as the requests they should serve are: the scheduler
step reads prompt text with prompt_special_tokens "text" by default (a typed "</s>" or "<s>" is characters,
not the special token), so a template must be too, or its pinned blocks are keyed under ids no request
ever sends and never hit."""

from __future__ import annotations

from tokenizers import Tokenizer

from engine.loader import load_templates
from scheduler.tokenize import PrefixTokenizer, treat_special_tokens
from tests.conftest import MODEL_DIR

TEXT = "<s>[INST] You are the support assistant. End every answer with </s> and nothing else. [/INST]"


def request_ids(text: str) -> list[int]:
    """What the slo_scheduler step sends the engine for `text` with its default parameters."""
    tokenizer = Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))
    treat_special_tokens(tokenizer, "text")  # config.pbtxt: ${LLM_PROMPT_SPECIAL_TOKENS:-text}
    return PrefixTokenizer(tokenizer)(text)


def test_a_template_spelling_special_tokens_is_tokenized_as_a_request_is(tmp_path):
    path = tmp_path / "templates.yaml"
    path.write_text(f"templates:\n  - tenant: default\n    text: '{TEXT}'\n", encoding="utf-8")
    prefixes, failures = load_templates(str(path), MODEL_DIR)
    assert failures == []
    ((ids, tenant),) = prefixes
    assert ids == request_ids(TEXT), "the template's blocks would be keyed under ids no request sends"
