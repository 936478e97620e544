"""EngineConfig: the engine's options in typed, frozen sections (model, mla, cache, scheduler, parallel,
speculative).

Flat option names exist only at the edges (`LLM(...)`, EngineArgs, CLI flags, the server's option dict):
`EngineConfig.from_kwargs` routes each to its section, and an unknown one is an error, not ignored. The deploy file
(config/deploy.py) builds the same sections from its own.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from mlaserve.config.engine_sections import (
    CacheOptions,
    MLAOptions,
    ModelOptions,
    ParallelOptions,
    SchedulerOptions,
)
from mlaserve.config.speculative import SpeculativeOptions

__all__ = [
    "CacheOptions",
    "EngineConfig",
    "MLAOptions",
    "ModelOptions",
    "ParallelOptions",
    "SchedulerOptions",
    "SpeculativeOptions",
]

# The flat option that names a field under another name: LLM(model=...) is the model section's path.
_RENAMED = {"model": "path"}
# Sections given whole, as one dict keyword (vLLM's spelling), rather than field by field.
_WHOLE = {"speculative_config": "speculative"}


@dataclass(frozen=True)
class EngineConfig:
    model: ModelOptions = field(default_factory=ModelOptions)
    mla: MLAOptions = field(default_factory=MLAOptions)
    cache: CacheOptions = field(default_factory=CacheOptions)
    scheduler: SchedulerOptions = field(default_factory=SchedulerOptions)
    parallel: ParallelOptions = field(default_factory=ParallelOptions)
    speculative: SpeculativeOptions = field(default_factory=SpeculativeOptions)

    @classmethod
    def from_kwargs(cls, **kwargs: object) -> EngineConfig:
        """Our options and the MLA deployment guides' names (config/guide_options.py); anything else is an error."""
        from mlaserve.config.guide_options import translate

        kwargs = translate(kwargs)
        sections = _sections()
        unknown = sorted(set(kwargs) - set(sections) - set(_WHOLE))
        if unknown:
            known = sorted([*sections, *_WHOLE])
            raise TypeError(f"unknown engine option(s) {unknown}; known options: {known}")
        grouped: dict[str, dict[str, object]] = {}
        for name, value in kwargs.items():
            if name not in _WHOLE:
                grouped.setdefault(sections[name], {})[_RENAMED.get(name, name)] = value
        whole = {section: option for option, section in _WHOLE.items()}
        built = {}
        # Built in the sections' order, so that of several bad options the same one is named every time.
        for f in dataclasses.fields(cls):
            if f.name in whole:  # SpeculativeOptions, the one section given whole
                built[f.name] = SpeculativeOptions.from_value(kwargs.get(whole[f.name]))
            else:
                built[f.name] = f.default_factory(**grouped.get(f.name, {}))
        return cls(**built)

    def as_kwargs(self, keep_none: bool = False) -> dict[str, object]:
        """The flat options from_kwargs takes back; unset (None) ones left out unless keep_none."""
        flat = {}
        for option, section_name in _WHOLE.items():
            value = getattr(self, section_name).as_dict()
            if value is not None or keep_none:
                flat[option] = value
        for section in dataclasses.fields(self):
            if section.name in _WHOLE.values():
                continue
            options = getattr(self, section.name)
            for f in dataclasses.fields(options):
                value = getattr(options, f.name)
                if value is not None or keep_none:
                    flat[_FLAT.get(f.name, f.name)] = value
        return flat


_FLAT = {field_name: option for option, field_name in _RENAMED.items()}


def _sections() -> dict[str, str]:
    """Each flat option name -> the section that holds it."""
    out = {}
    for section in dataclasses.fields(EngineConfig):
        if section.name in _WHOLE.values():
            continue
        for f in dataclasses.fields(section.default_factory):
            out[_FLAT.get(f.name, f.name)] = section.name
    return out
