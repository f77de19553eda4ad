"""Names that are not known, and the known name that was probably meant ("did you mean `default_cap`?").

A misspelt setting is worse than a bad value: traitlets keeps it as config nobody reads, so the server runs
on the default the admin meant to change. Everything that reads names an admin writes (c.GpuQuota's
settings, the keys of a caps rule, the keys of the hub's per-user mapping) says which name it does not know
and the closest one it does, in these words. Pure, standard library only.
"""

from __future__ import annotations

import difflib
from typing import Iterable, List, Mapping, Optional, Sequence

# difflib's own default: "default_caps" -> "default_cap", "gpu_mem" -> "gpu_memory", but "colour" -> nothing.
CUTOFF = 0.6


def closest(name: str, known: Iterable[str]) -> Optional[str]:
    """The known name most like `name`, or None when none is close enough to be a guess worth showing."""
    matches = difflib.get_close_matches(str(name), [str(k) for k in known], n=1, cutoff=CUTOFF)
    return matches[0] if matches else None


def did_you_mean(unknown: Sequence[str], known: Iterable[str]) -> str:
    """The end of the line that refuses `unknown` names: "; did you mean `default_cap`?", with each unknown
    name beside its guess when there are several, or "" when none is close to a known name."""
    known = list(known)
    guesses = [(str(name), closest(name, known)) for name in unknown]
    guesses = [(name, guess) for name, guess in guesses if guess is not None]
    if not guesses:
        return ""
    if len(unknown) == 1:
        return f"; did you mean `{guesses[0][1]}`?"
    return "; did you mean " + ", ".join(f"`{guess}` for `{name}`" for name, guess in guesses) + "?"


def unknown_setting(section: str, name: str, known: Iterable[str]) -> str:
    """One unknown name in a config section: "c.GpuQuota.default_caps is not a setting of GpuQuota; did you
    mean `default_cap`?". `jupyter gpu-quota check` refuses with it; the server warns with it."""
    return f"c.{section}.{name} is not a setting of {section}{did_you_mean([name], known)}"


def is_section_key(key: str) -> bool:
    """A config key that names a subsection (a class), as traitlets tells them: it starts with a capital."""
    return bool(key) and key[0].isupper()


def unknown_settings(section: str, given: Mapping[str, object], known: Iterable[str]) -> List[str]:
    """One line per name that `given` (a config section) sets and no trait of the section's class has, in
    the order they were given. Subsections are not settings and are left to their own class."""
    known = list(known)
    return [
        unknown_setting(section, name, known)
        for name in given
        if isinstance(name, str) and not is_section_key(name) and name not in known
    ]


def unknown_variables(environ: Mapping[str, str], prefix: str, known: Iterable[str], meant: Iterable[str]) -> List[str]:
    """One line per variable of the environment named like ours (`prefix`) that nothing reads and that looks
    like one a setting reads (`meant`): "$GPU_QUOTA_DEFAULT_CAPS is set, but nothing reads it; did you mean
    `GPU_QUOTA_DEFAULT_CAP`?". Only those close to a setting's variable: an environment carries variables of
    other tools too, and a guess that is not close is no help. The prefix, shared by all, is left out of the
    comparison, or every name would look close to every other."""
    known, meant = set(known), list(meant)
    stems = {name[len(prefix) :]: name for name in meant if name.startswith(prefix)}
    lines = []
    for name in sorted(environ):
        if not name.startswith(prefix) or name in known:
            continue
        guess = closest(name[len(prefix) :], stems)
        if guess is not None:
            lines.append(f"${name} is set, but nothing reads it; did you mean `{stems[guess]}`?")
    return lines
