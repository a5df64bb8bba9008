"""Emoji image + name pairs: a small, real, offline paired data set for dual encoders.

The package ships ``peft_ext/data/files/emoji_pairs.npz``: every fully-qualified emoji of Unicode's emoji list
(``emoji-test.txt``, Emoji 15.0 in Debian's ``unicode-data``) rendered with the Noto Color Emoji font (Debian's
``fonts-noto-color-emoji``) at 32 x 32 RGB on white, paired with its CLDR short name ("grinning face") and labelled
with its group (9 classes, e.g. "Food & Drink") and subgroup (~100 classes, e.g. "food-fruit").

Skin-tone variants are dropped (sequences containing U+1F3FB..U+1F3FF, and the "Component" group of bare modifiers
and hair components): a "waving hand: medium skin tone" in the test split next to "waving hand" in the train split
would make the test set a near copy of the training set. What remains is one image per distinct emoji.

The train/test split is a fixed function of the code point sequence (SHA-1, about 20% test), like the WordNet data.
The validation split is another fixed function of the same hash (its next four bytes): about 20% of the *train*
split, so it never meets the test split. ``load_emoji_pairs("train")`` keeps its 1,507 pairs (validation included)
so that existing configs and cached backbones are unchanged; ``load_emoji_pairs("train", hold_out_validation=True)``
is the train split without them, disjoint from ``load_emoji_pairs("validation")``.
Build it with :func:`build_emoji_pairs` (``python -m peft_ext.multimodal build``); load it with
:func:`load_emoji_pairs`, which needs nothing outside this package. Licenses: ``files/UNICODE_LICENSE`` (the list)
and ``files/NOTO_EMOJI_LICENSE`` (the font, SIL OFL 1.1); see ``files/EMOJI_README.md``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = [
    "DEFAULT_FONT",
    "DEFAULT_PATH",
    "DEFAULT_TEST_FILE",
    "IMAGE_SIZE",
    "SKIN_TONES",
    "EmojiPairs",
    "EmojiRecord",
    "build_emoji_pairs",
    "load_emoji_pairs",
    "parse_emoji_test",
    "render_emoji",
    "split_of",
    "validation_of",
]

DEFAULT_PATH = Path(__file__).resolve().parent.parent / "data" / "files" / "emoji_pairs.npz"
DEFAULT_TEST_FILE = Path("/usr/share/unicode/emoji/emoji-test.txt")
DEFAULT_FONT = Path("/usr/share/fonts/truetype/noto/NotoColorEmoji.ttf")
IMAGE_SIZE = 32
SKIN_TONES = frozenset(range(0x1F3FB, 0x1F400))
TEST_PERCENT = 20
VALIDATION_PERCENT = 20  # of the train split
SPLITS = (None, "train", "validation", "test")
# Noto Color Emoji is a bitmap (CBDT) font with one strike: FreeType only opens it at this pixel size.
_NOTO_STRIKE = 109


@dataclass(frozen=True)
class EmojiRecord:
    """One line of ``emoji-test.txt``.

    Args:
        codepoints: The code points in hex, space-separated, e.g. ``"1F600"``.
        name: The CLDR short name, e.g. ``"grinning face"``.
        group: e.g. ``"Smileys & Emotion"``.
        subgroup: e.g. ``"face-smiling"``.
    """

    codepoints: str
    name: str
    group: str
    subgroup: str

    @property
    def text(self) -> str:
        """The emoji itself as a string."""
        return "".join(chr(int(c, 16)) for c in self.codepoints.split())


def parse_emoji_test(lines: list[str], *, drop_skin_tones: bool = True) -> list[EmojiRecord]:
    """The fully-qualified emoji of an ``emoji-test.txt``, in file order.

    Args:
        lines: The file's lines.
        drop_skin_tones: Drop sequences with a skin-tone modifier and the "Component" group (see the module docs).

    Raises:
        ValueError: If a data line comes before any ``# group:`` / ``# subgroup:`` header or is malformed.
    """
    group = subgroup = None
    records = []
    for number, raw in enumerate(lines, 1):
        line = raw.strip()
        if line.startswith("# group:"):
            group = line.split(":", 1)[1].strip()
            continue
        if line.startswith("# subgroup:"):
            subgroup = line.split(":", 1)[1].strip()
            continue
        if not line or line.startswith("#"):
            continue
        fields, _, comment = line.partition("#")
        codepoints, _, status = fields.partition(";")
        if not status or not comment:
            raise ValueError(f"line {number} of emoji-test.txt is malformed: {raw!r}")
        if status.strip() != "fully-qualified":
            continue
        if group is None or subgroup is None:
            raise ValueError(f"line {number} of emoji-test.txt comes before a group/subgroup header: {raw!r}")
        # comment: "<emoji> E<version> <name>"
        parts = comment.strip().split(" ", 2)
        if len(parts) != 3 or not parts[1].startswith("E"):
            raise ValueError(f"line {number} of emoji-test.txt has no '<emoji> E<version> <name>' comment: {raw!r}")
        record = EmojiRecord(" ".join(codepoints.split()), parts[2], group, subgroup)
        if drop_skin_tones and (
            group == "Component" or any(int(c, 16) in SKIN_TONES for c in record.codepoints.split())
        ):
            continue
        records.append(record)
    return records


def split_of(codepoints: str) -> str:
    """``"test"`` for about 20% of the emoji (a SHA-1 of the code points), else ``"train"``.

    Args:
        codepoints: Hex code points, space-separated.
    """
    digest = hashlib.sha1(codepoints.encode("ascii")).digest()
    return "test" if int.from_bytes(digest[:4], "big") % 100 < TEST_PERCENT else "train"


def validation_of(codepoints: str) -> bool:
    """Whether a *train* emoji belongs to the validation split: about 20% of them, by bytes 4-7 of the same SHA-1 as
    :func:`split_of` (independent of bytes 0-3, which decide train vs test). ``False`` for every test emoji.

    Args:
        codepoints: Hex code points, space-separated.
    """
    if split_of(codepoints) != "train":
        return False
    digest = hashlib.sha1(codepoints.encode("ascii")).digest()
    return int.from_bytes(digest[4:8], "big") % 100 < VALIDATION_PERCENT


def render_emoji(text: str, font, size: int = IMAGE_SIZE) -> np.ndarray | None:
    """Render one emoji on white, cropped to its ink, centred in a square and resized to ``size`` x ``size``.

    Args:
        text: The emoji string.
        font: A Pillow ``FreeTypeFont`` of Noto Color Emoji.
        size: Output side in pixels.

    Returns:
        ``uint8`` array ``(size, size, 3)``, or ``None`` when the font has no single glyph for the sequence (it
        would be drawn as several glyphs side by side).
    """
    from PIL import Image, ImageDraw

    left, top, right, bottom = font.getbbox(text)
    if right - left > 1.5 * (bottom - top):
        return None
    canvas = Image.new("RGBA", (right - left + 8, bottom - top + 8), (0, 0, 0, 0))
    ImageDraw.Draw(canvas).text((4 - left, 4 - top), text, font=font, embedded_color=True)
    box = canvas.getbbox()
    if box is None:
        return None
    glyph = canvas.crop(box)
    side = max(glyph.size)
    square = Image.new("RGBA", (side, side), (255, 255, 255, 255))
    square.alpha_composite(glyph, ((side - glyph.size[0]) // 2, (side - glyph.size[1]) // 2))
    return np.asarray(square.convert("RGB").resize((size, size), Image.Resampling.LANCZOS), dtype=np.uint8)


@dataclass(frozen=True)
class EmojiPairs:
    """The paired data set (one split or all of it).

    Args:
        images: ``uint8`` ``(N, 32, 32, 3)``, white background.
        names: The CLDR short names (the text side).
        codepoints: Hex code points per emoji.
        group: Group label per emoji, an index into ``group_names``.
        subgroup: Subgroup label per emoji, an index into ``subgroup_names``.
        group_names: The 9 group names, in file order.
        subgroup_names: The subgroup names, in file order.
    """

    images: np.ndarray
    names: list[str]
    codepoints: list[str]
    group: np.ndarray
    subgroup: np.ndarray
    group_names: list[str]
    subgroup_names: list[str]

    def __len__(self) -> int:
        return len(self.names)

    def subset(self, index: np.ndarray) -> EmojiPairs:
        """The rows ``index`` (an int or bool array)."""
        index = np.asarray(index)
        pick = np.flatnonzero(index) if index.dtype == bool else index
        return EmojiPairs(
            self.images[pick],
            [self.names[i] for i in pick],
            [self.codepoints[i] for i in pick],
            self.group[pick],
            self.subgroup[pick],
            self.group_names,
            self.subgroup_names,
        )


def build_emoji_pairs(
    test_file: Path = DEFAULT_TEST_FILE, font_path: Path = DEFAULT_FONT, out: Path | None = DEFAULT_PATH
) -> EmojiPairs:
    """Render the data set from ``emoji-test.txt`` and Noto Color Emoji; write it to ``out`` unless ``None``.

    Deterministic: the same input files and Pillow/FreeType give the same arrays.

    Args:
        test_file: Unicode's ``emoji-test.txt``.
        font_path: ``NotoColorEmoji.ttf``.
        out: Where to write the ``.npz`` (``None``: do not write).

    Raises:
        FileNotFoundError: If an input is missing (``apt-get install unicode-data fonts-noto-color-emoji``).
    """
    from PIL import ImageFont

    for path in (test_file, font_path):
        if not Path(path).is_file():
            raise FileNotFoundError(
                f"{path} not found; install Debian's unicode-data and fonts-noto-color-emoji or pass its path"
            )
    records = parse_emoji_test(Path(test_file).read_text(encoding="utf-8").splitlines())
    font = ImageFont.truetype(str(font_path), _NOTO_STRIKE)
    kept, images = [], []
    for record in records:
        image = render_emoji(record.text, font)
        if image is not None:
            kept.append(record)
            images.append(image)
    group_names = list(dict.fromkeys(r.group for r in kept))
    subgroup_names = list(dict.fromkeys(r.subgroup for r in kept))
    pairs = EmojiPairs(
        images=np.stack(images),
        names=[r.name for r in kept],
        codepoints=[r.codepoints for r in kept],
        group=np.array([group_names.index(r.group) for r in kept], dtype=np.int64),
        subgroup=np.array([subgroup_names.index(r.subgroup) for r in kept], dtype=np.int64),
        group_names=group_names,
        subgroup_names=subgroup_names,
    )
    if out is not None:
        np.savez_compressed(
            out,
            images=pairs.images,
            names=np.array(pairs.names),
            codepoints=np.array(pairs.codepoints),
            group=pairs.group,
            subgroup=pairs.subgroup,
            group_names=np.array(group_names),
            subgroup_names=np.array(subgroup_names),
        )
    return pairs


def load_emoji_pairs(
    split: str | None = None, path: Path = DEFAULT_PATH, *, hold_out_validation: bool = False
) -> EmojiPairs:
    """Load the committed data set.

    Args:
        split: ``"train"``, ``"validation"`` (a fixed ~20% of the train split, :func:`validation_of`), ``"test"``
            or ``None`` (everything).
        path: The ``.npz`` file.
        hold_out_validation: With ``split="train"``, leave out the validation pairs (then the three splits are
            disjoint). ``False``: the whole train split, validation pairs included.

    Raises:
        ValueError: If ``split`` is not one of those, or ``hold_out_validation`` is set for another split.
    """
    if split not in SPLITS:
        raise ValueError(f"`split` must be 'train', 'validation', 'test' or None, got {split!r}")
    if hold_out_validation and split != "train":
        raise ValueError(f"`hold_out_validation=True` applies to split='train' only, got split={split!r}")
    with np.load(path, allow_pickle=False) as data:
        pairs = EmojiPairs(
            images=data["images"],
            names=data["names"].tolist(),
            codepoints=data["codepoints"].tolist(),
            group=data["group"],
            subgroup=data["subgroup"],
            group_names=data["group_names"].tolist(),
            subgroup_names=data["subgroup_names"].tolist(),
        )
    if split is None:
        return pairs
    if split == "validation":
        return pairs.subset(np.array([validation_of(c) for c in pairs.codepoints]))
    keep = [split_of(c) == split and not (hold_out_validation and validation_of(c)) for c in pairs.codepoints]
    return pairs.subset(np.array(keep))
