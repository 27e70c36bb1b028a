"""The recipes and QUANT_CONFIGs that ship with hqtflow: the repository's `recipes/` and `quantization_config/` (links
here in a checkout, copies in a wheel), so `--recipe smollm2` or `-c maxabs_quant` work from an installed package."""
from __future__ import annotations

from pathlib import Path

RECIPES = Path(__file__).parent / "recipes"
CONFIGS = Path(__file__).parent / "quantization_config"


def names(folder: Path, suffix: str) -> list[str]:
    """The bundled files of `folder`, by the name a user may give (without `suffix`)."""
    return sorted(p.name.removesuffix(suffix) for p in folder.glob(f"*{suffix}"))


def resolve(path: str | Path, folder: Path, suffix: str) -> Path:
    """PATH as given when it is a file or names a folder (has a `/`); else the bundled file of that bare name (with or
    without `suffix`), when there is one; else PATH as given, for the caller's one-sentence refusal."""
    p = Path(path)
    if p.is_file() or len(p.parts) != 1:
        return p
    bundled = folder / f"{p.name.removesuffix(suffix)}{suffix}"
    return bundled if bundled.is_file() else p


def hint(path: str | Path, folder: Path, suffix: str, label: str = "bundled") -> str:
    """The end of a 'does not exist' sentence: for a bare name, the bundled names one may give instead; for a path
    whose file name is a near miss of a bundled one (a recipe's misspelled `maxabs_quat`, resolved beside it), that
    one."""
    if len(Path(path).parts) == 1:
        return f"; {label}: {', '.join(names(folder, suffix))}"
    import difflib

    near = difflib.get_close_matches(Path(path).name.removesuffix(suffix), names(folder, suffix), n=1, cutoff=0.8)
    return f" (did you mean the bundled {near[0]}?)" if near else ""
