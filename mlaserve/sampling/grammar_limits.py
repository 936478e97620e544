"""How large a structured-output constraint may be, and how long its compile may take.

llguidance's compile time grows faster than linearly with a grammar's size (a choice list is one regex
alternation, whose lexer grows with every entry), and a compile cannot be interrupted once started. So a request
is measured before anything is compiled: past a cap it is refused at once, naming the field. What passes the caps
compiles in well under a second; the deadline is for what the caps cannot see (a machine under load, a small
grammar that happens to be costly), and a compile that misses it is left to finish on its worker while the
client gets its 400.

The server takes these from the deploy config's server section (server_settings.py); the offline API uses the
defaults.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from mlaserve.sampling.grammar_error import GrammarError
from mlaserve.sampling_params import StructuredOutputsParams

# Each cap keeps a compile to a small fraction of a second on one core; a list or schema near it is already far
# past what a client writes by hand, and larger ones are the pattern of a client probing the server.
MAX_CHOICE_ENTRIES = 10_000
MAX_CHOICE_BYTES = 256 * 1024
MAX_GRAMMAR_BYTES = 256 * 1024  # a JSON schema (as compact JSON), a regex or a Lark grammar
GRAMMAR_COMPILE_TIMEOUT_S = 5.0


@dataclass(frozen=True, slots=True)
class GrammarLimits:
    max_choice_entries: int = MAX_CHOICE_ENTRIES
    max_choice_bytes: int = MAX_CHOICE_BYTES
    max_grammar_bytes: int = MAX_GRAMMAR_BYTES
    compile_timeout_s: float = GRAMMAR_COMPILE_TIMEOUT_S

    def check(self, params: StructuredOutputsParams) -> None:
        """GrammarError naming the kind if `params` is past a size cap; costs one pass over the text."""
        kind = params.kind
        if kind == "choice":
            if len(params.choice) > self.max_choice_entries:
                raise GrammarError(
                    kind,
                    f"{len(params.choice)} entries is more than the {self.max_choice_entries} a choice list "
                    "may hold",
                )
            size = sum(len(c.encode("utf-8", "surrogatepass")) for c in params.choice)
            if size > self.max_choice_bytes:
                raise GrammarError(
                    kind,
                    f"the entries hold {size} bytes together, more than the {self.max_choice_bytes} allowed",
                )
            return
        size = len(_source_bytes(params))
        if size > self.max_grammar_bytes:
            raise GrammarError(kind, f"it is {size} bytes, more than the {self.max_grammar_bytes} allowed")

    def deadline_error(self, kind: str) -> GrammarError:
        return GrammarError(
            kind,
            f"compiling it took longer than the {self.compile_timeout_s:g} s allowed; send a smaller constraint",
        )


def _source_bytes(params: StructuredOutputsParams) -> bytes:
    kind = params.kind
    if kind == "json":
        schema = params.json
        text = schema if isinstance(schema, str) else json.dumps(schema, separators=(",", ":"))
    else:
        text = {"regex": params.regex, "grammar": params.grammar}.get(kind) or ""
    return text.encode("utf-8", "surrogatepass")
