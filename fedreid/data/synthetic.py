"""A seeded synthetic multi-domain person re-identification world.

Real ReID images cannot be shipped, so this module draws small stand-ins for
the ten datasets of the FedReID benchmark and writes each one **in its
official release layout** (``datasets/README.md``): the same folders, file
names and quirks (Market-1501's ``Thumbs.db``, ``*.jpg.jpg`` files, junk
``-1_*`` and distractor ``0000_*`` boxes; MSMT17_V1's list files; PRID2011's
single- and multi-shot folders; ...). The whole real pipeline (raw parsers,
``tools/prepare_datasets.py``, federated training) then runs on it unchanged.

The world model
---------------
* **Identities** are persistent appearance parameters: upper and lower
  clothing colour (from a shared palette, so many people share colours), a
  torso pattern (solid, horizontal or vertical stripes, checks, a logo block)
  with its own colour and period, sleeve and lower-garment style (trousers,
  shorts, skirt), body proportions (height, width, leg length), skin and hair
  tone, long hair, and accessories (a bag on one side, a backpack, a hat).
  A person is recognisable only by the *combination* of these.
* **Cameras** change what an image shows of a person: viewpoint (front, back
  or side: the back hides the logo and shows the backpack, the side narrows
  the body and moves the bag over it), white balance and colour cast
  (per-channel gain and bias), brightness and contrast, scale and position of
  the person box, blur, sensor noise, and a textured background of their own
  (street with floor tiles, indoor panels, foliage, clutter). Images of one
  person in one camera come from one tracklet: they share viewpoint and
  framing, as real detections of one walk do, and differ by small jitter.
* **Domains** (datasets) add a style on top: clothing-palette bias (Duke's
  winter coats are darker than Market's summer clothes), capture resolution
  (VIPeR and i-LIDS are blurry upscales), detector misalignment, background
  families, colour cast and file format. The federation of clients is
  therefore non-IID, and unbalanced because identity counts follow the real
  datasets' sizes.

Identity is recoverable across cameras (body-part colours and patterns
survive), but no trivial cue gives it away: the camera's colour cast and
background dominate the global mean colour, and box jitter and patterns make
any fixed pixel unreliable.

Knobs (arguments of :func:`generate_world`)
-------------------------------------------
``id_scale``
    Fraction of each real dataset's identity count (0.02 gives a few thousand
    images in all).
``min_ids``
    Fewest identities of any dataset, however small ``id_scale``.
``images_per_camera``
    Most images of one identity in one camera (each count is drawn in
    ``1..images_per_camera``; VIPeR and PRID's single shot have exactly one,
    CUHK01 at most two as its views 001-004 allow).
``height``, ``width``
    Image size in pixels.
``seed``
    Everything is drawn from ``np.random.SeedSequence(seed)`` children keyed
    by dataset, identity, camera, tracklet and image, so the same seed gives
    the same bytes, and generating one dataset alone gives the same files as
    generating it with the others.

``raw_root/synthetic_world.json`` records the parameters and, for the
datasets whose release fixes the split (Market-1501, DukeMTMC-reID, CUHK03-NP
detected, MSMT17, CUHK02), the ``counts`` the parsers must find; the prepare
tool checks against them instead of the paper's Table 1. ``parser_options``
holds the options a parser needs for the scaled-down world (PRID2011's number
of shared persons).
"""

from __future__ import annotations

import json
import shutil
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Optional, Sequence

import cv2
import numpy as np

GENERATOR = "fedreid.data.synthetic"
#: Bumped whenever the same parameters would produce different bytes.
GENERATOR_VERSION = 1
WORLD_FILE = "synthetic_world.json"

#: Registry name -> release folder under the raw root (the parsers' ``dataset_dir``).
RELEASE_DIRS: dict[str, str] = {
    "msmt17": "MSMT17_V1",
    "dukemtmc": "DukeMTMC-reID",
    "market1501": "Market-1501-v15.09.15",
    "cuhk03np": "cuhk03-np",
    "prid2011": "prid_2011",
    "cuhk01": "CUHK01",
    "viper": "VIPeR",
    "3dpes": "3DPeS",
    "ilids": "i-LIDS_Pedestrian",
    "cuhk02": "cuhk02",
}
DATASETS: tuple[str, ...] = tuple(RELEASE_DIRS)

# Supersampling factor: people are drawn at SS x the output size and reduced
# with area interpolation, which anti-aliases edges and allows sub-pixel jitter.
_SS = 2
# Fixed-point bits of cv2 drawing coordinates (sub-pixel precision).
_SHIFT = 3
_ONE = 1 << _SHIFT

VIEWS: tuple[str, ...] = ("front", "back", "side")

# ---------------------------------------------------------------------------
# Colours
# ---------------------------------------------------------------------------

#: Clothing / object palette (RGB). Deliberately small, so that colours are
#: shared by many identities and only combinations identify a person.
_PALETTE = np.array(
    [
        (28, 28, 32),  # black
        (64, 64, 70),  # charcoal
        (126, 126, 130),  # grey
        (226, 226, 220),  # white
        (32, 42, 94),  # navy
        (52, 96, 182),  # blue
        (134, 174, 222),  # sky
        (36, 128, 128),  # teal
        (52, 128, 62),  # green
        (108, 112, 52),  # olive
        (196, 178, 136),  # khaki
        (108, 72, 44),  # brown
        (184, 36, 42),  # red
        (108, 30, 44),  # maroon
        (228, 148, 170),  # pink
        (226, 128, 40),  # orange
        (224, 198, 60),  # yellow
        (108, 58, 138),  # purple
    ],
    dtype=np.float32,
)
_LUMA = _PALETTE @ np.array([0.299, 0.587, 0.114], dtype=np.float32) / 255.0
_SKIN = np.array(
    [(236, 204, 180), (224, 186, 156), (198, 150, 118), (160, 112, 80), (112, 76, 52)],
    dtype=np.float32,
)
_HAIR = np.array(
    [(20, 18, 18), (58, 40, 30), (100, 70, 45), (190, 160, 100), (150, 150, 150)],
    dtype=np.float32,
)
_SHOES = np.array([(20, 20, 22), (60, 45, 35), (120, 120, 120), (225, 225, 225)], dtype=np.float32)

_PATTERNS: tuple[str, ...] = ("solid", "hstripes", "vstripes", "checks", "logo")


# ---------------------------------------------------------------------------
# Seeds
# ---------------------------------------------------------------------------

# Kinds of seed streams, so that e.g. identity 3 and camera 3 never share one.
_PLAN, _STYLE, _IDENTITY, _CAMERA, _TRACK, _IMAGE = range(6)


def _dataset_code(name: str) -> int:
    """A stable integer per dataset: its streams do not depend on which others run."""
    return zlib.crc32(name.encode("ascii"))


def _rng(seed: int, name: str, kind: int, *key: int) -> np.random.Generator:
    spawn_key = (_dataset_code(name), kind) + tuple(int(k) for k in key)
    return np.random.default_rng(np.random.SeedSequence(seed, spawn_key=spawn_key))


# ---------------------------------------------------------------------------
# Domain styles
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _StyleSpec:
    """Hand-set look of one dataset (domain); the rest is drawn from its seed."""

    ext: str  # file format of the release
    res: float  # capture resolution relative to the output (<1: blurry upscale)
    blur: float  # Gaussian blur sigma in output pixels (scaled per camera)
    noise: float  # sensor noise sigma in grey levels (scaled per camera)
    misalign: float  # detector box jitter relative to a typical detector
    darkness: float  # >0 darker clothing (winter), <0 brighter (summer)
    backgrounds: tuple[str, ...]  # background families of its cameras
    cast: tuple[float, float, float]  # RGB gain of the whole domain
    quality: int = 90  # JPEG quality where ext is jpg


_STYLES: dict[str, _StyleSpec] = {
    # name: _StyleSpec(ext, res, blur, noise, misalign, darkness, backgrounds, cast[, quality])
    "msmt17": _StyleSpec("jpg", 0.9, 0.5, 4.0, 1.0, 0.3,
                         ("street", "indoor", "clutter", "foliage"), (1.0, 1.0, 1.0), 88),
    "dukemtmc": _StyleSpec("jpg", 1.0, 0.4, 3.0, 0.8, 0.8,
                           ("street", "foliage"), (1.03, 1.0, 0.95), 92),
    "market1501": _StyleSpec("jpg", 0.75, 0.6, 5.0, 1.3, -0.4,
                             ("street", "clutter"), (1.0, 1.03, 0.97), 85),
    "cuhk03np": _StyleSpec("png", 0.7, 0.7, 3.0, 1.2, 0.0,
                           ("indoor", "clutter"), (0.96, 1.0, 1.06)),
    "prid2011": _StyleSpec("png", 0.6, 0.8, 6.0, 0.6, 0.2,
                           ("street", "foliage"), (1.06, 1.0, 0.92)),
    "cuhk01": _StyleSpec("png", 1.0, 0.3, 2.0, 0.5, 0.0,
                         ("street", "indoor"), (1.0, 1.0, 1.0)),
    "viper": _StyleSpec("bmp", 0.55, 0.7, 5.0, 0.5, -0.1,
                        ("street", "foliage"), (1.05, 1.02, 0.9)),
    "3dpes": _StyleSpec("bmp", 0.8, 0.5, 4.0, 0.7, 0.1,
                        ("foliage", "street"), (0.97, 1.04, 0.98)),
    "ilids": _StyleSpec("jpg", 0.55, 0.8, 5.0, 0.8, 0.4,
                        ("indoor", "clutter"), (1.07, 1.0, 0.9), 80),
    "cuhk02": _StyleSpec("png", 1.0, 0.3, 2.0, 0.5, 0.0,
                         ("street", "indoor"), (1.0, 1.0, 1.0)),
}


@dataclass(frozen=True, eq=False)
class _Style:
    spec: _StyleSpec
    palette_p: np.ndarray  # clothing colour probabilities of this domain
    skin_p: np.ndarray
    hair_p: np.ndarray


def _make_style(seed: int, name: str) -> _Style:
    spec = _STYLES[name]
    rng = _rng(seed, name, _STYLE)
    # Each domain prefers some colours (its own fashion), shifted dark or bright.
    weights = rng.dirichlet(np.full(len(_PALETTE), 4.0)) * np.exp(-2.0 * spec.darkness * _LUMA)
    return _Style(
        spec=spec,
        palette_p=weights / weights.sum(),
        skin_p=rng.dirichlet(np.full(len(_SKIN), 1.5)),
        hair_p=rng.dirichlet(np.full(len(_HAIR), 1.0) + np.array([3.0, 1.0, 0.5, 0, 0])),
    )


# ---------------------------------------------------------------------------
# Identities
# ---------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class Identity:
    """Persistent appearance of one person (colours RGB float, sizes relative)."""

    upper: np.ndarray
    lower: np.ndarray
    pattern: str
    pattern_colour: np.ndarray
    period: float  # stripe / check period, fraction of the body height
    short_sleeves: bool
    lower_style: str  # trousers / shorts / skirt
    shoes: np.ndarray
    skin: np.ndarray
    hair: np.ndarray
    long_hair: bool
    height: float  # body height relative to the camera's typical person
    width: float  # shoulder width / body height
    leg: float  # leg length / body height
    bag: int  # 0 none, -1 on the person's left, +1 on the right
    bag_colour: np.ndarray
    backpack: bool
    backpack_colour: np.ndarray
    hat: bool
    hat_colour: np.ndarray


def _colour(rng: np.random.Generator, table: np.ndarray, p: np.ndarray,
            avoid: Optional[int] = None) -> tuple[np.ndarray, int]:
    """A colour of ``table`` (index != avoid) with a small personal variation."""
    if avoid is not None:
        p = p.copy()
        p[avoid] = 0.0
        p /= p.sum()
    index = int(rng.choice(len(table), p=p))
    # Same palette colour, slightly different fabric: shared colours stay close.
    tint = table[index] * rng.uniform(0.9, 1.1) + rng.normal(0.0, 6.0, 3)
    return np.clip(tint, 0, 255).astype(np.float32), index


def _make_identity(rng: np.random.Generator, style: _Style) -> Identity:
    upper, upper_i = _colour(rng, _PALETTE, style.palette_p)
    lower, _ = _colour(rng, _PALETTE, style.palette_p)
    pattern_colour, _ = _colour(rng, _PALETTE, np.full(len(_PALETTE), 1 / len(_PALETTE)), upper_i)
    uniform = np.full(len(_PALETTE), 1 / len(_PALETTE))
    return Identity(
        upper=upper,
        lower=lower,
        pattern=str(rng.choice(_PATTERNS, p=[0.34, 0.18, 0.12, 0.12, 0.24])),
        pattern_colour=pattern_colour,
        period=float(rng.uniform(0.05, 0.09)),
        short_sleeves=bool(rng.random() < 0.35),
        lower_style=str(rng.choice(("trousers", "shorts", "skirt"), p=[0.7, 0.15, 0.15])),
        shoes=_colour(rng, _SHOES, np.array([0.5, 0.2, 0.1, 0.2]))[0],
        skin=_colour(rng, _SKIN, style.skin_p)[0],
        hair=_colour(rng, _HAIR, style.hair_p)[0],
        long_hair=bool(rng.random() < 0.25),
        height=float(rng.uniform(0.88, 1.0)),
        width=float(rng.uniform(0.23, 0.33)),
        leg=float(rng.uniform(0.43, 0.52)),
        bag=int(rng.choice((0, -1, 1), p=[0.6, 0.2, 0.2])),
        bag_colour=_colour(rng, _PALETTE, uniform)[0],
        backpack=bool(rng.random() < 0.25),
        backpack_colour=_colour(rng, _PALETTE, uniform)[0],
        hat=bool(rng.random() < 0.12),
        hat_colour=_colour(rng, _PALETTE, uniform)[0],
    )


# ---------------------------------------------------------------------------
# Cameras and backgrounds
# ---------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class Camera:
    gain: np.ndarray  # per-channel gain (white balance x domain cast)
    bias: np.ndarray  # per-channel offset (grey levels)
    brightness: float
    contrast: float
    blur: float  # Gaussian sigma, output pixels
    noise: float  # noise sigma, grey levels
    view_p: np.ndarray  # probabilities of front / back / side
    scale: tuple[float, float]  # person height / image height
    jitter: float  # box position jitter, fraction of the image size
    background: np.ndarray  # uint8 (H + 2 pad, W + 2 pad, 3) at supersampled size
    pad: int


def _fill(canvas: np.ndarray, pts: Iterable[tuple[float, float]], colour: np.ndarray) -> None:
    """Filled polygon with sub-pixel vertices (x, y)."""
    arr = np.round(np.asarray(list(pts), dtype=np.float64) * _ONE).astype(np.int32)
    cv2.fillPoly(canvas, [arr], _bgr_tuple(colour), cv2.LINE_AA, _SHIFT)


def _rect(canvas: np.ndarray, x0: float, y0: float, x1: float, y1: float,
          colour: np.ndarray) -> None:
    _fill(canvas, ((x0, y0), (x1, y0), (x1, y1), (x0, y1)), colour)


def _ellipse(canvas: np.ndarray, cx: float, cy: float, rx: float, ry: float, colour: np.ndarray,
             start: float = 0.0, end: float = 360.0) -> None:
    cv2.ellipse(canvas, (round(cx * _ONE), round(cy * _ONE)),
                (max(1, round(rx * _ONE)), max(1, round(ry * _ONE))),
                0.0, start, end, _bgr_tuple(colour), -1, cv2.LINE_AA, _SHIFT)


def _bgr_tuple(colour: np.ndarray) -> tuple[float, float, float]:
    # Canvases are RGB; cv2 only sees a 3-tuple, so the order is ours.
    return (float(colour[0]), float(colour[1]), float(colour[2]))


def _scene_colour(rng: np.random.Generator, dim: float = 1.0) -> np.ndarray:
    """A background colour: a palette colour washed towards grey (walls, floors)."""
    base = _PALETTE[rng.integers(len(_PALETTE))]
    grey = np.float32(rng.uniform(70, 190))
    return np.clip((rng.uniform(0.3, 0.8) * base + 0.5 * grey) * dim, 0, 255).astype(np.float32)


def _background(rng: np.random.Generator, family: str, hb: int, wb: int) -> np.ndarray:
    """One camera's scene, larger than the image so each shot can crop it differently."""
    yy = np.linspace(0.0, 1.0, hb, dtype=np.float32)[:, None, None]
    top, bottom = _scene_colour(rng), _scene_colour(rng)
    canvas = (top * (1 - yy) + bottom * yy) * np.ones((1, wb, 1), np.float32)
    horizon = int(hb * rng.uniform(0.45, 0.7))
    floor = _scene_colour(rng)
    if family == "street":
        # Buildings / shop fronts above the horizon, perspective floor tiles below.
        x = 0
        while x < wb:
            step = int(rng.integers(wb // 6, wb // 2))
            _rect(canvas, x, 0, x + step, horizon * rng.uniform(0.3, 1.0), _scene_colour(rng, 0.9))
            x += step + int(rng.integers(0, wb // 8))
        canvas[horizon:] = floor
        y, gap, shade = float(horizon), hb * 0.03, 0
        while y < hb:
            if shade % 2:
                canvas[int(y):int(y + gap)] *= 0.88
            y, gap, shade = y + gap, gap * 1.35, shade + 1
    elif family == "indoor":
        # Wall panels and a door; checkered floor.
        for _ in range(int(rng.integers(2, 5))):
            x0 = rng.uniform(-0.2, 1.0) * wb
            _rect(canvas, x0, rng.uniform(0.05, 0.3) * hb, x0 + rng.uniform(0.15, 0.45) * wb,
                  horizon, _scene_colour(rng))
        canvas[horizon:] = floor
        tile = max(2, int(rng.integers(hb // 20, hb // 8)))
        ys, xs = np.mgrid[0:hb - horizon, 0:wb]
        checker = ((ys // tile + xs // tile) % 2).astype(bool)
        canvas[horizon:][checker] *= 0.85
    elif family == "foliage":
        # Low-frequency noise between two colours (trees, lawn), a path below.
        noise = rng.random((6, 4)).astype(np.float32)
        noise = cv2.resize(noise, (wb, hb), interpolation=cv2.INTER_CUBIC)[..., None]
        leaf = np.array((50, 110, 50), np.float32) * rng.uniform(0.6, 1.2, 3).astype(np.float32)
        canvas = canvas * (1 - noise) + leaf * noise
        canvas[horizon:] = floor
    else:  # clutter: parked bikes, benches, other people, as blobs of colour
        canvas[horizon:] = floor
        for _ in range(int(rng.integers(5, 12))):
            cx, cy = rng.uniform(0, wb), rng.uniform(0.1, 0.95) * hb
            rx, ry = rng.uniform(0.05, 0.25) * wb, rng.uniform(0.03, 0.15) * hb
            colour = _PALETTE[rng.integers(len(_PALETTE))] * rng.uniform(0.6, 1.0)
            if rng.random() < 0.5:
                _rect(canvas, cx - rx, cy - ry, cx + rx, cy + ry, colour)
            else:
                _ellipse(canvas, cx, cy, rx, ry, colour)
    # Fine texture so the background is never flat.
    canvas += rng.normal(0.0, 6.0, (hb, wb, 1)).astype(np.float32)
    canvas = cv2.GaussianBlur(canvas, (0, 0), 1.0)
    return np.clip(canvas, 0, 255).astype(np.uint8)


def _make_camera(rng: np.random.Generator, style: _Style, h: int, w: int,
                 view_p: Optional[Sequence[float]] = None) -> Camera:
    spec = style.spec
    tint = rng.uniform(-0.15, 0.15)  # warm (+) or cool (-) white balance
    gain = np.array(spec.cast) * np.array([1 + tint, 1.0, 1 - tint]) * rng.uniform(0.9, 1.1, 3)
    pad = int(round(0.25 * w * _SS))
    family = str(rng.choice(spec.backgrounds))
    lo = rng.uniform(0.74, 0.86)
    return Camera(
        gain=gain.astype(np.float32),
        bias=rng.uniform(-15, 15, 3).astype(np.float32),
        brightness=float(rng.uniform(0.7, 1.1)),
        contrast=float(rng.uniform(0.75, 1.1)),
        blur=float(spec.blur * rng.uniform(0.6, 1.4)),
        noise=float(spec.noise * rng.uniform(0.6, 1.4)),
        # A camera sees people walk mostly one way: its own mix of viewpoints.
        view_p=np.asarray(view_p if view_p is not None else rng.dirichlet([1.2, 1.2, 0.8]), float),
        scale=(float(lo), float(lo + 0.1)),
        jitter=float(rng.uniform(0.03, 0.07) * spec.misalign),
        background=_background(rng, family, h * _SS + 2 * pad, w * _SS + 2 * pad),
        pad=pad,
    )


# ---------------------------------------------------------------------------
# Drawing a person
# ---------------------------------------------------------------------------


def _torso_pattern(canvas: np.ndarray, mask: np.ndarray, ident: Identity, x0: float, y0: float,
                   bh: float, narrow: float) -> None:
    """Fill the torso mask with the upper colour and the identity's pattern."""
    m = mask > 0
    if ident.pattern in ("hstripes", "vstripes", "checks"):
        ys, xs = np.nonzero(m)
        period = ident.period * bh
        rows = np.floor((ys - y0) / period).astype(np.int64) % 2
        # Vertical stripes follow the body: narrower when seen from the side.
        cols = np.floor((xs - x0) / (period * narrow)).astype(np.int64) % 2
        on = {"hstripes": rows, "vstripes": cols, "checks": rows ^ cols}[ident.pattern].astype(bool)
        canvas[ys, xs] = np.where(on[:, None], ident.pattern_colour, ident.upper)
    else:
        canvas[m] = ident.upper


def _draw_person(canvas: np.ndarray, ident: Identity, view: str, facing: int, cx: float,
                 top: float, bh: float, stride: float) -> None:
    """Draw ``ident`` seen from ``view`` in a box of height ``bh`` at (cx, top).

    ``facing`` (+1 walking to the image's right) matters for side views;
    ``stride`` in [-1, 1] is the walking phase.
    """
    side = view == "side"
    narrow = 0.62 if side else 1.0
    bw = ident.width * bh * narrow
    shoulder = top + 0.15 * bh
    waist = top + (1.0 - ident.leg) * bh
    feet = top + 0.965 * bh
    sole = top + bh
    # The person's left appears on the image's right when seen from the front.
    bag_x = {"front": -ident.bag, "back": ident.bag}.get(view, 0)
    visible_side = -facing  # walking right shows the left side to the camera

    # Behind the body: a backpack seen from the side, a bag on the far side.
    if side and ident.backpack:
        bx = cx - facing * bw / 2
        _rect(canvas, bx - facing * 0.32 * bh * ident.width, shoulder + 0.02 * bh, bx,
              shoulder + 0.32 * bh, ident.backpack_colour)
    if side and ident.bag and ident.bag != visible_side:
        _rect(canvas, cx - 0.5 * bw, waist - 0.1 * bh, cx + 0.1 * bw, waist + 0.06 * bh,
              ident.bag_colour)

    # Legs and shoes.
    leg_w = (0.55 if side else 0.4) * bw
    if side:
        swing = 0.1 * bh * stride
        legs = [(cx - swing, cx + swing), (cx + swing, cx - swing)]
        hip_half = 0.5 * leg_w
    else:
        off = 0.42 * bw - leg_w / 2 + 0.02 * bh * abs(stride)
        legs = [(cx - off, cx - off), (cx + off, cx + off)]
        hip_half = leg_w / 2
    knee = waist + (feet - waist) * (0.45 if ident.lower_style == "shorts" else 0.55)
    for hip_x, foot_x in legs:
        leg = ((hip_x - hip_half, waist), (hip_x + hip_half, waist),
               (foot_x + leg_w / 2, feet), (foot_x - leg_w / 2, feet))
        _fill(canvas, leg, ident.lower if ident.lower_style == "trousers" else ident.skin)
        if ident.lower_style == "shorts":
            t = (knee - waist) / (feet - waist)
            kx = hip_x + (foot_x - hip_x) * t
            _fill(canvas, ((hip_x - hip_half, waist), (hip_x + hip_half, waist),
                           (kx + leg_w / 2, knee), (kx - leg_w / 2, knee)), ident.lower)
        toe = facing * 0.05 * bh if side else 0.0
        _rect(canvas, foot_x - leg_w / 2 + min(toe, 0), feet, foot_x + leg_w / 2 + max(toe, 0),
              sole, ident.shoes)
    if ident.lower_style == "skirt":
        _fill(canvas, ((cx - 0.45 * bw, waist - 0.01 * bh), (cx + 0.45 * bw, waist - 0.01 * bh),
                       (cx + 0.6 * bw, knee), (cx - 0.6 * bw, knee)), ident.lower)

    # Torso with its pattern (drawn into a mask, then textured).
    torso = ((cx - bw / 2, shoulder), (cx + bw / 2, shoulder),
             (cx + 0.44 * bw, waist + 0.03 * bh), (cx - 0.44 * bw, waist + 0.03 * bh))
    mask = np.zeros(canvas.shape[:2], np.uint8)
    _fill(mask, torso, np.array([255, 255, 255]))
    _torso_pattern(canvas, mask, ident, cx - bw / 2, shoulder, bh, narrow)
    if ident.pattern == "logo" and view == "front":
        _rect(canvas, cx - 0.22 * bw, shoulder + 0.05 * bh, cx + 0.22 * bw, shoulder + 0.17 * bh,
              ident.pattern_colour)

    # Arms: at the sides from the front and back, one arm over the body from the side.
    arm_w = 0.2 * ident.width * bh
    hand_y = shoulder + 0.34 * bh
    arm_xs = [cx + 0.1 * facing * bw * stride] if side else [cx - bw / 2 - arm_w * 0.45,
                                                              cx + bw / 2 + arm_w * 0.45]
    for ax in arm_xs:
        spread = 0.0 if side else np.sign(ax - cx) * 0.03 * bh
        arm = ((ax - arm_w / 2, shoulder), (ax + arm_w / 2, shoulder),
               (ax + spread + arm_w / 2, hand_y), (ax + spread - arm_w / 2, hand_y))
        _fill(canvas, arm, ident.upper)
        if ident.short_sleeves:
            elbow = shoulder + 0.13 * bh
            ex = ax + spread * 0.4  # the forearm starts at the elbow, below the sleeve
            _fill(canvas, ((ex - arm_w / 2, elbow), (ex + arm_w / 2, elbow),
                           (ax + spread + arm_w / 2, hand_y), (ax + spread - arm_w / 2, hand_y)),
                  ident.skin)
        _ellipse(canvas, ax + spread, hand_y, arm_w * 0.6, arm_w * 0.7, ident.skin)

    # Head, hair, hat.
    head_y, ry = top + 0.075 * bh, 0.068 * bh
    rx = 0.052 * bh
    if ident.long_hair and view != "front":
        _rect(canvas, cx - rx, head_y, cx + rx * (0.3 if side else 1.0), shoulder + 0.12 * bh,
              ident.hair)
    if ident.long_hair and view == "front":
        _rect(canvas, cx - rx * 1.05, head_y, cx + rx * 1.05, shoulder + 0.04 * bh, ident.hair)
    _ellipse(canvas, cx, head_y, rx, ry, ident.hair if view == "back" else ident.skin)
    if view != "back":
        # Hair caps the head; from the side it covers the back of the head.
        if side:
            _ellipse(canvas, cx - facing * 0.25 * rx, head_y - 0.2 * ry, rx * 0.85, ry * 0.85,
                     ident.hair)
            _ellipse(canvas, cx + facing * 0.35 * rx, head_y + 0.15 * ry, rx * 0.6, ry * 0.7,
                     ident.skin)
        else:
            _ellipse(canvas, cx, head_y - 0.1 * ry, rx * 1.02, ry * 0.95, ident.hair, 180, 360)
    if ident.hat:
        _ellipse(canvas, cx, head_y - 0.35 * ry, rx * 1.15, ry * 0.75, ident.hat_colour, 180, 360)
        _rect(canvas, cx - rx * 1.25, head_y - 0.4 * ry, cx + rx * 1.25, head_y - 0.2 * ry,
              ident.hat_colour)

    # In front of the body: backpack (back), straps (front), bag on the near side.
    if ident.backpack and view == "back":
        _rect(canvas, cx - 0.36 * bw, shoulder + 0.03 * bh, cx + 0.36 * bw, shoulder + 0.3 * bh,
              ident.backpack_colour)
    elif ident.backpack and view == "front":
        for sx in (-0.3, 0.3):
            _rect(canvas, cx + (sx - 0.06) * bw, shoulder, cx + (sx + 0.06) * bw,
                  shoulder + 0.18 * bh, ident.backpack_colour)
    if ident.bag:
        bag_w, bag_h = 0.35 * ident.width * bh, 0.16 * bh
        if side:
            if ident.bag == visible_side:
                bx = cx - facing * 0.1 * bw
                _rect(canvas, bx - bag_w / 2, waist - 0.1 * bh, bx + bag_w / 2,
                      waist - 0.1 * bh + bag_h, ident.bag_colour)
        else:
            bx = cx + bag_x * (bw / 2 + arm_w + bag_w * 0.3)
            _rect(canvas, bx - bag_w / 2, waist - 0.08 * bh, bx + bag_w / 2,
                  waist - 0.08 * bh + bag_h, ident.bag_colour)


# ---------------------------------------------------------------------------
# Rendering one image
# ---------------------------------------------------------------------------

#: Viewing angle of VIPeR's file names -> the viewpoint drawn.
_ANGLE_VIEW = {0: "front", 45: "front", 90: "side", 135: "back", 180: "back"}


@dataclass(frozen=True)
class _Shot:
    """One image to write: who, by which camera, and with which seeds."""

    rel: str  # path relative to the release folder
    ident: Optional[int]  # identity index in the dataset, None for a background-only box
    cam: int  # camera index in the dataset
    track: tuple[int, ...]  # tracklet key: images of one walk share viewpoint and framing
    key: int  # image key (per-image jitter and noise)
    kind: str = "person"  # person / junk (misaligned box) / distractor (no one known)
    view: Optional[str] = None  # forced viewpoint (VIPeR's angle); else drawn per tracklet
    crop: float = 1.0  # scale of the box misalignment (hand-drawn boxes are tighter)
    light: tuple[float, float, float] = (1.0, 1.0, 1.0)  # time-of-day illumination


def _render(shot: _Shot, ident: Optional[Identity], cam: Camera, style: _Style,
            trk: np.random.Generator, rng: np.random.Generator, h: int, w: int) -> np.ndarray:
    """The RGB uint8 image of ``shot``; ``trk`` is its tracklet's stream, ``rng`` its own."""
    H, W = h * _SS, w * _SS
    # Tracklet-level draws first, in a fixed order, so images of one walk agree.
    oy0, ox0 = trk.integers(0, 2 * cam.pad + 1, 2)
    view = shot.view or str(trk.choice(VIEWS, p=cam.view_p))
    facing = int(trk.choice((-1, 1)))
    phase = trk.uniform(-1, 1)
    scale = trk.uniform(*cam.scale)
    shift = trk.uniform(-1, 1, 2)
    light_grad = trk.uniform(-0.25, 0.25, 2)
    illum = trk.uniform(0.88, 1.12)

    oy = int(np.clip(oy0 + rng.integers(-2, 3), 0, 2 * cam.pad))
    ox = int(np.clip(ox0 + rng.integers(-2, 3), 0, 2 * cam.pad))
    canvas = cam.background[oy:oy + H, ox:ox + W].copy()
    if rng.random() < 0.3:  # a passer-by or a pole behind the person
        px = rng.uniform(0, W)
        _rect(canvas, px - rng.uniform(0.05, 0.2) * W, rng.uniform(0, 0.5) * H,
              px + rng.uniform(0.05, 0.2) * W, H, _PALETTE[rng.integers(len(_PALETTE))] * 0.8)

    jitter = rng.normal(0.0, 0.25, 2)
    stride = float(np.clip(phase + rng.normal(0.0, 0.3), -1, 1))
    bh = scale * (ident.height if ident is not None else 1.0) * H * (1 + rng.normal(0, 0.02))
    dx, dy = (shift + jitter) * cam.jitter * shot.crop
    cx = W / 2 + dx * W
    top = (H - bh) / 2 + dy * H
    if shot.kind == "junk":
        # A bad detection: the box cuts the person, too high/low or too wide.
        if rng.random() < 0.5:
            cx += rng.choice((-1, 1)) * rng.uniform(0.35, 0.6) * W
        else:
            top += rng.choice((-1, 1)) * rng.uniform(0.3, 0.5) * H
    if ident is not None:
        _draw_person(canvas, ident, view, facing, cx, top, bh, stride)
    if rng.random() < 0.06:  # an occluder in front (railing, car bonnet)
        y0 = rng.uniform(0.75, 0.9) * H
        _rect(canvas, 0, y0, W, H, _PALETTE[rng.integers(len(_PALETTE))] * 0.7)

    img = cv2.resize(canvas, (w, h), interpolation=cv2.INTER_AREA).astype(np.float32)
    spec = style.spec
    if spec.res < 1.0:  # captured at lower resolution, upscaled by the release
        small = (max(2, round(w * spec.res)), max(2, round(h * spec.res)))
        img = cv2.resize(cv2.resize(img, small, interpolation=cv2.INTER_AREA), (w, h),
                         interpolation=cv2.INTER_LINEAR)
    # Lighting: a soft gradient across the image, then the camera's response.
    ys = np.linspace(-0.5, 0.5, h, dtype=np.float32)[:, None, None]
    xs = np.linspace(-0.5, 0.5, w, dtype=np.float32)[None, :, None]
    img = img * (1.0 + light_grad[0] * ys + light_grad[1] * xs)
    img = (img - 128.0) * cam.contrast + 128.0
    gain = cam.gain * np.asarray(shot.light, np.float32) * np.float32(cam.brightness * illum)
    img = img * gain + cam.bias
    if cam.blur > 0.3:
        img = cv2.GaussianBlur(img, (0, 0), cam.blur)
    img = img + rng.normal(0.0, cam.noise, img.shape).astype(np.float32)
    return np.clip(np.rint(img), 0, 255).astype(np.uint8)


def _encode(img: np.ndarray, ext: str, quality: int) -> bytes:
    bgr = np.ascontiguousarray(img[..., ::-1])
    if ext == "jpg":
        ok, buf = cv2.imencode(".jpg", bgr, [cv2.IMWRITE_JPEG_QUALITY, quality])
    elif ext == "png":
        ok, buf = cv2.imencode(".png", bgr, [cv2.IMWRITE_PNG_COMPRESSION, 3])
    else:
        ok, buf = cv2.imencode("." + ext, bgr)
    if not ok:
        raise RuntimeError(f"cv2 could not encode a .{ext} image")
    return buf.tobytes()


# ---------------------------------------------------------------------------
# Planning a dataset: which files exist, who is in them
# ---------------------------------------------------------------------------

#: Real identity counts the scaled counts derive from (PRID2011: 200 shared +
#: 185 camera-A-only + 549 camera-B-only persons, scaled part by part).
REAL_IDS: dict[str, int] = {
    "msmt17": 4101, "dukemtmc": 1404, "market1501": 1501, "cuhk03np": 1467,
    "prid2011": 934, "cuhk01": 971, "viper": 632, "3dpes": 193, "ilids": 119, "cuhk02": 1816,
}
#: Cameras of each dataset (3DPeS: 8 real views; i-LIDS: 2 hidden ones; CUHK02: 5 pairs x 2).
NUM_CAMERAS: dict[str, int] = {
    "msmt17": 15, "dukemtmc": 8, "market1501": 6, "cuhk03np": 2, "prid2011": 2,
    "cuhk01": 2, "viper": 2, "3dpes": 8, "ilids": 2, "cuhk02": 10,
}
_THUMBS_DB = bytes.fromhex("d0cf11e0a1b11ae1") + bytes(504)  # an OLE header, as Windows writes


@dataclass
class _Plan:
    """Everything one dataset's release folder will hold."""

    name: str
    seed: int
    params: dict
    rng: np.random.Generator
    shots: list[_Shot] = field(default_factory=list)
    files: dict[str, bytes] = field(default_factory=dict)  # non-image files
    dirs: list[str] = field(default_factory=list)  # folders that exist even if empty
    camera_views: dict[int, Sequence[float]] = field(default_factory=dict)
    num_ids: int = 0
    counts: Optional[dict] = None  # what the parser must find (fixed splits only)
    parser_options: Optional[dict] = None

    @property
    def ipc(self) -> int:
        return int(self.params["images_per_camera"])

    def scaled(self, real: Optional[int] = None) -> int:
        """Identity count for a real one (default: the dataset's), never below ``min_ids``."""
        real = REAL_IDS[self.name] if real is None else real
        return max(int(self.params["min_ids"]), int(round(real * self.params["id_scale"])))

    def shot(self, rel: str, ident: Optional[int], cam: int, track: tuple[int, ...],
             **kw) -> _Shot:
        key = kw.pop("key", len(self.shots))
        s = _Shot(rel, ident, cam, track, key, **kw)
        self.shots.append(s)
        return s

    def numbers(self, n: int, first: int, real_last: int) -> list[int]:
        """``n`` sorted distinct id numbers spread over the real range (with its gaps)."""
        last = max(real_last, first + n - 1)
        return sorted(int(v) for v in self.rng.choice(np.arange(first, last + 1), n, replace=False))

    def split_train(self, n: int, real_train: int, real_total: int) -> np.ndarray:
        """Boolean mask of training identities, keeping the real train/test ratio."""
        n_train = min(n - 1, max(1, int(round(n * real_train / real_total))))
        train = np.zeros(n, bool)
        train[self.rng.permutation(n)[:n_train]] = True
        return train

    def cameras_of(self, popularity: np.ndarray, k_choices: Sequence[int],
                   k_p: Sequence[float]) -> dict[int, int]:
        """Cameras that see an identity (busy cameras more often) -> images in each."""
        k = int(self.rng.choice(k_choices, p=k_p))
        cams = self.rng.choice(len(popularity), size=min(k, len(popularity)), replace=False,
                               p=popularity)
        return {int(c): int(self.rng.integers(1, self.ipc + 1)) for c in sorted(cams)}


def _query_cameras(rng: np.random.Generator, counts: dict[int, int], every: bool) -> set[int]:
    """Cameras giving one query image each, so that every query keeps a match.

    ``every``: one query from each camera that has a second image left for
    the gallery (Market, Duke and CUHK03 query every camera), else a random
    proper subset (MSMT17). A query of camera c needs a gallery image of the
    same person from another camera.
    """
    cams = sorted(counts)
    if every:
        chosen = {c for c in cams if counts[c] >= 2} or {int(rng.choice(cams))}
    else:
        k = int(rng.integers(1, len(cams)))
        chosen = {int(c) for c in rng.choice(cams, k, replace=False)}

    def valid(q: set[int]) -> bool:
        gallery = {c for c in cams if counts[c] - (c in q) >= 1}
        return all(gallery - {c} for c in q)

    while not valid(chosen):
        # Dropping a single-image camera from the query set returns it to the gallery.
        single = sorted(c for c in chosen if counts[c] == 1) or sorted(chosen)
        chosen.discard(int(rng.choice(single)))
    return chosen


def _popularity(rng: np.random.Generator, n: int) -> np.ndarray:
    p = rng.dirichlet(np.full(n, 3.0))
    return p / p.sum()


def _frames(rng: np.random.Generator, n: int, last: int, step: tuple[int, int]) -> list[int]:
    """Increasing frame numbers of one tracklet, all below ``last`` (fixed-width names)."""
    start = int(rng.integers(0, max(1, last - step[1] * n)))
    return [int(v) for v in start + np.cumsum(rng.integers(step[0], step[1], n))]


def _plan_market(p: _Plan) -> None:
    n = p.num_ids = p.scaled()
    numbers = p.numbers(n, 1, 1501)
    train = p.split_train(n, 751, 1501)
    pop = _popularity(p.rng, 6)
    query: list[_Shot] = []
    train_shots: list[_Shot] = []
    gallery_real = 0

    def name(pid: str, cam: int, seq: int, frame: int, box: int) -> str:
        return f"{pid}_c{cam + 1}s{seq}_{frame:06d}_{box:02d}.jpg"

    for i, pid in enumerate(numbers):
        counts = p.cameras_of(pop, (2, 3, 4, 5, 6), (0.1, 0.15, 0.25, 0.3, 0.2))
        q = set() if train[i] else _query_cameras(p.rng, counts, every=True)
        for cam, k in counts.items():
            seq = int(p.rng.integers(1, 7))
            for j, frame in enumerate(_frames(p.rng, k, 999_999, (5, 80))):
                box = int(p.rng.integers(1, 4))
                fname = name(f"{pid:04d}", cam, seq, frame, box)
                if train[i]:
                    train_shots.append(p.shot(f"bounding_box_train/{fname}", i, cam, (i, cam)))
                elif cam in q and j == 0:
                    query.append(p.shot(f"query/{fname}", i, cam, (i, cam)))
                else:
                    p.shot(f"bounding_box_test/{fname}", i, cam, (i, cam))
                    gallery_real += 1
    # Junk (-1: badly cut boxes of test people) and distractors (0000: nobody
    # of the dataset) in the real proportions: about 2.8k and 3.8k of 19.7k.
    test_idx = [i for i in range(n) if not train[i]]
    n_junk = max(1, round(gallery_real * 2798 / 13115))
    n_distractor = max(1, round(gallery_real * 3819 / 13115))
    used: set[str] = set()
    for kind, count, prefix in (("junk", n_junk, "-1"), ("distractor", n_distractor, "0000")):
        for j in range(count):
            cam = int(p.rng.choice(6, p=pop))
            while True:
                fname = name(prefix, cam, int(p.rng.integers(1, 7)),
                             int(p.rng.integers(0, 200000)), int(p.rng.integers(1, 9)))
                if fname not in used:
                    used.add(fname)
                    break
            if kind == "junk":
                ident = int(p.rng.choice(test_idx))
                p.shot(f"bounding_box_test/{fname}", ident, cam, (ident, cam), kind="junk")
            else:
                # A stranger (an identity index outside the dataset) or an empty box.
                stranger = 1_000_000 + j if p.rng.random() < 0.6 else None
                p.shot(f"bounding_box_test/{fname}", stranger, cam, (2_000_000 + j, cam),
                       kind="distractor")
    # Two real images carry a doubled extension in the release.
    for j in sorted(p.rng.choice(len(train_shots), size=min(2, len(train_shots)), replace=False)):
        old = train_shots[int(j)]
        doubled = _Shot(old.rel + ".jpg", old.ident, old.cam, old.track, old.key)
        p.shots[p.shots.index(old)] = doubled
    # Hand-drawn boxes of the queries (not used by the benchmark): tighter crops.
    for s in query:
        p.shot("gt_bbox/" + s.rel.split("/", 1)[1], s.ident, s.cam, s.track, key=s.key, crop=0.3)
    p.dirs += ["gt_query"]
    p.files["bounding_box_test/Thumbs.db"] = _THUMBS_DB
    p.counts = _split_counts(p.shots, train="bounding_box_train/", query="query/",
                             gallery="bounding_box_test/", pid=_market_pid)


def _market_pid(rel: str) -> int:
    return int(rel.rsplit("/", 1)[1].split("_", 1)[0])


def _split_counts(shots: Sequence[_Shot], train: str, query: str, gallery: str,
                  pid: Callable[[str], int]) -> dict:
    """The parser-visible counts of a release with fixed folders per split."""
    def of(prefix: str) -> list[str]:
        return [s.rel for s in shots if s.rel.startswith(prefix)]

    tr, qu, ga = of(train), of(query), of(gallery)
    return {
        "train_ids": len({pid(r) for r in tr}),
        "train_images": len(tr),
        "query_ids": len({pid(r) for r in qu}),
        "query_images": len(qu),
        "gallery_images": len(ga),
    }


def _plan_duke(p: _Plan) -> None:
    n = p.num_ids = p.scaled()
    n_distractor = max(1, round(n * 408 / 1404))
    numbers = p.numbers(n + n_distractor, 1, 7140)
    # Distractor ids are interleaved with the others in the numbering.
    order = p.rng.permutation(n + n_distractor)
    person_numbers = sorted(numbers[k] for k in order[:n])
    distractor_numbers = sorted(numbers[k] for k in order[n:])
    train = p.split_train(n, 702, 1404)
    pop = _popularity(p.rng, 8)

    def name(pid: int, cam: int, frame: int) -> str:
        return f"{pid:04d}_c{cam + 1}_f{frame:07d}.jpg"

    for i, pid in enumerate(person_numbers):
        counts = p.cameras_of(pop, (2, 3, 4, 5), (0.35, 0.35, 0.2, 0.1))
        q = set() if train[i] else _query_cameras(p.rng, counts, every=True)
        for cam, k in counts.items():
            for j, frame in enumerate(_frames(p.rng, k, 9_999_999, (10, 200))):
                folder = ("bounding_box_train" if train[i]
                          else "query" if cam in q and j == 0 else "bounding_box_test")
                p.shot(f"{folder}/{name(pid, cam, frame)}", i, cam, (i, cam))
    for j, pid in enumerate(distractor_numbers):
        ident = n + j  # real people, only never queried
        for cam, k in p.cameras_of(pop, (1, 2), (0.6, 0.4)).items():
            for frame in _frames(p.rng, k, 9_999_999, (10, 200)):
                p.shot(f"bounding_box_test/{name(pid, cam, frame)}", ident, cam, (ident, cam))
    p.counts = _split_counts(p.shots, "bounding_box_train/", "query/", "bounding_box_test/",
                             _market_pid)


def _plan_cuhk03(p: _Plan) -> None:
    n = p.num_ids = p.scaled()
    numbers = p.numbers(n, 1, 1467)
    train = p.split_train(n, 767, 1467)
    detected: list[_Shot] = []
    for i, pid in enumerate(numbers):
        counts = {cam: int(p.rng.integers(1, p.ipc + 1)) for cam in (0, 1)}
        q = set() if train[i] else _query_cameras(p.rng, counts, every=True)
        index = 0
        for cam, k in counts.items():
            for j in range(k):
                index += 1
                folder = ("bounding_box_train" if train[i]
                          else "query" if cam in q and j == 0 else "bounding_box_test")
                detected.append(p.shot(f"detected/{folder}/{pid:04d}_c{cam + 1}_{index}.png",
                                       i, cam, (i, cam)))
    # The labeled set: the same people and frames, hand-drawn (tighter) boxes.
    for s in detected:
        p.shot("labeled/" + s.rel.split("/", 1)[1], s.ident, s.cam, s.track, key=s.key, crop=0.35)
    p.counts = _split_counts(p.shots, "detected/bounding_box_train/", "detected/query/",
                             "detected/bounding_box_test/", _market_pid)


# MSMT17's capture sessions: four days, three times of day with their light.
_MSMT_DAYS = ("0113", "0114", "0302", "0303")
_MSMT_TIMES = {
    "morning": (0.82, 0.86, 0.95),
    "noon": (1.12, 1.1, 1.05),
    "afternoon": (1.05, 0.95, 0.82),
}


def _plan_msmt(p: _Plan) -> None:
    n = p.num_ids = p.scaled()
    train = p.split_train(n, 1041, 4101)
    pop = _popularity(p.rng, 15)
    times = tuple(_MSMT_TIMES)
    lists: dict[str, list[str]] = {"train": [], "val": [], "query": [], "gallery": []}
    next_pid = {"train": 0, "test": 0}  # test ids restart at 0000, as in the release
    for i in range(n):
        folder = "train" if train[i] else "test"
        pid = next_pid[folder]
        next_pid[folder] += 1
        counts = p.cameras_of(pop, (2, 3, 4, 5, 6), (0.2, 0.3, 0.25, 0.15, 0.1))
        q = set() if train[i] else _query_cameras(p.rng, counts, every=False)
        images: list[str] = []
        for seq, (cam, k) in enumerate(counts.items()):
            day = _MSMT_DAYS[int(p.rng.integers(len(_MSMT_DAYS)))]
            tod = times[int(p.rng.integers(len(times)))]
            for j, frame in enumerate(_frames(p.rng, k, 9999, (3, 40))):
                fname = f"{pid:04d}_{seq:03d}_{cam + 1:02d}_{day}{tod}_{frame:04d}_{j % 3}.jpg"
                p.shot(f"{folder}/{pid:04d}/{fname}", i, cam, (i, cam), light=_MSMT_TIMES[tod])
                line = f"{pid:04d}/{fname} {pid}"
                if train[i]:
                    images.append(line)
                else:
                    lists["query" if cam in q and j == 0 else "gallery"].append(line)
        if train[i]:
            # The official val list: about 7% of the training images, never an
            # identity's only one.
            for j, line in enumerate(images):
                lists["val" if j > 0 and p.rng.random() < 0.15 else "train"].append(line)
    if not lists["val"]:
        lists["val"].append(lists["train"].pop())  # at least one, so the list is not empty
    for split, lines in lists.items():
        p.files[f"list_{split}.txt"] = "".join(line + "\n" for line in sorted(lines)).encode()

    def ids(lines: list[str]) -> int:
        return len({line.rsplit(" ", 1)[1] for line in lines})

    p.counts = {
        "train_ids": ids(lists["train"] + lists["val"]),
        "train_images": len(lists["train"]) + len(lists["val"]),
        "query_ids": ids(lists["query"]),
        "query_images": len(lists["query"]),
        "gallery_images": len(lists["gallery"]),
    }


def _plan_prid(p: _Plan) -> None:
    # Shared persons (real 200), camera-A-only (185), camera-B-only (549).
    shared = p.scaled(200)
    a_only = max(1, int(round(185 * p.params["id_scale"])))
    b_only = max(1, int(round(549 * p.params["id_scale"])))
    p.num_ids = shared + a_only + b_only
    # person_NNNN numbers per camera: the shared persons first, in both cameras.
    people = {0: list(range(shared)) + list(range(shared, shared + a_only)),
              1: list(range(shared)) + list(range(shared + a_only, p.num_ids))}
    for cam, cam_dir in ((0, "cam_a"), (1, "cam_b")):
        for number, ident in enumerate(people[cam], start=1):
            track = (ident, cam)
            p.shot(f"single_shot/{cam_dir}/person_{number:04d}.png", ident, cam, track)
            for frame in range(1, int(p.rng.integers(1, p.ipc + 1)) + 1):
                p.shot(f"multi_shot/{cam_dir}/person_{number:04d}/{frame:04d}.png", ident, cam,
                       track)
    p.parser_options = {"num_shared": shared}


def _plan_cuhk01(p: _Plan) -> None:
    n = p.num_ids = p.scaled()
    # Camera A sees people from the front or back, camera B from the side.
    p.camera_views = {0: (0.5, 0.5, 0.0), 1: (0.1, 0.1, 0.8)}
    for i in range(n):
        for cam in (0, 1):
            for v in range(int(p.rng.integers(1, min(p.ipc, 2) + 1))):
                p.shot(f"campus/{i + 1:04d}{2 * cam + v + 1:03d}.png", i, cam, (i, cam))


def _plan_viper(p: _Plan) -> None:
    n = p.num_ids = p.scaled()
    numbers = p.numbers(n, 0, 873)  # the release's numbers run to 873 with gaps
    width = max(3, len(str(numbers[-1])))  # sorted names must keep the pairing
    angles = np.array(sorted(_ANGLE_VIEW))
    for i, number in enumerate(numbers):
        a = int(p.rng.choice(angles))
        # The two cameras see a person from viewpoints 90-180 degrees apart.
        b = int(p.rng.choice(angles[np.abs(angles - a) >= 90]))
        for cam, (cam_dir, angle) in enumerate((("cam_a", a), ("cam_b", b))):
            p.shot(f"{cam_dir}/{number:0{width}d}_{angle}.bmp", i, cam, (i, cam),
                   view=_ANGLE_VIEW[angle])


def _plan_3dpes(p: _Plan) -> None:
    n = p.num_ids = p.scaled()
    numbers = p.numbers(n, 1, 200)
    pop = _popularity(p.rng, 8)
    for i, number in enumerate(numbers):
        # Some people are seen from one view only (they never become queries).
        counts = p.cameras_of(pop, (1, 2, 3, 4), (0.12, 0.5, 0.28, 0.1))
        for cam, k in counts.items():
            for frame in _frames(p.rng, k, 400, (2, 30)):
                p.shot(f"RGB/{number}_{cam + 1}_FRAME_{frame}_RGB.bmp", i, cam, (i, cam))


def _plan_ilids(p: _Plan) -> None:
    n = p.num_ids = p.scaled()
    for i in range(n):
        # Two hidden cameras; sorted images show the first one, then the second,
        # so the parser's halving into pseudo-cameras separates them roughly.
        first = int(p.rng.integers(2))
        index = 0
        for cam in (first, 1 - first):
            for _ in range(int(p.rng.integers(1, p.ipc + 1))):
                index += 1
                p.shot(f"Persons/{i + 1:04d}{index:03d}.jpg", i, cam, (i, cam))


def _plan_cuhk02(p: _Plan) -> None:
    n = p.num_ids = p.scaled()
    real = np.array([971, 306, 107, 193, 239], float)
    # Largest-remainder allocation over the five camera pairs, at least one each.
    share = real / real.sum() * max(n, 5)
    alloc = np.maximum(1, np.floor(share)).astype(int)
    for k in np.argsort(-(share - np.floor(share)), kind="stable"):
        if alloc.sum() >= max(n, 5):
            break
        alloc[k] += 1
    p.num_ids = int(alloc.sum())
    ident = 0
    for pair, count in enumerate(alloc, start=1):
        for number in range(1, count + 1):
            for c in (1, 2):
                cam = 2 * (pair - 1) + (c - 1)
                for j in range(1, int(p.rng.integers(1, p.ipc + 1)) + 1):
                    p.shot(f"Dataset/P{pair}/cam{c}/{number:03d}_{j}.png", ident, cam, (ident, cam))
            ident += 1
    p.counts = {"train_ids": p.num_ids, "train_images": len(p.shots), "query_ids": 0,
                "query_images": 0, "gallery_images": 0}


_PLANNERS: dict[str, Callable[[_Plan], None]] = {
    "msmt17": _plan_msmt,
    "dukemtmc": _plan_duke,
    "market1501": _plan_market,
    "cuhk03np": _plan_cuhk03,
    "prid2011": _plan_prid,
    "cuhk01": _plan_cuhk01,
    "viper": _plan_viper,
    "3dpes": _plan_3dpes,
    "ilids": _plan_ilids,
    "cuhk02": _plan_cuhk02,
}


def _plan(name: str, params: dict) -> _Plan:
    seed = int(params["seed"])
    plan = _Plan(name=name, seed=seed, params=params, rng=_rng(seed, name, _PLAN))
    _PLANNERS[name](plan)
    return plan


# ---------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------


def _write_plan(plan: _Plan, folder: Path, h: int, w: int, tick: Callable[[int], None]) -> None:
    name, seed = plan.name, plan.seed
    style = _make_style(seed, name)
    cameras = [
        _make_camera(_rng(seed, name, _CAMERA, c), style, h, w, plan.camera_views.get(c))
        for c in range(NUM_CAMERAS[name])
    ]
    identities: dict[int, Identity] = {}
    for rel in plan.dirs:
        (folder / rel).mkdir(parents=True, exist_ok=True)
    made: set[Path] = set()
    for shot in plan.shots:
        ident = None
        if shot.ident is not None:
            if shot.ident not in identities:
                id_rng = _rng(seed, name, _IDENTITY, shot.ident)
                identities[shot.ident] = _make_identity(id_rng, style)
            ident = identities[shot.ident]
        track_rng = _rng(seed, name, _TRACK, *shot.track)
        image_rng = _rng(seed, name, _IMAGE, shot.key)
        img = _render(shot, ident, cameras[shot.cam], style, track_rng, image_rng, h, w)
        path = folder / shot.rel
        if path.parent not in made:
            path.parent.mkdir(parents=True, exist_ok=True)
            made.add(path.parent)
        path.write_bytes(_encode(img, style.spec.ext, style.spec.quality))
        tick(1)
    for rel, data in plan.files.items():
        path = folder / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


def _read_world(path: Path) -> Optional[dict]:
    if not path.is_file():
        return None
    try:
        world = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return world if isinstance(world, dict) and world.get("generator") == GENERATOR else None


def _write_world(path: Path, world: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(world, indent=2, sort_keys=True) + "\n")
    tmp.replace(path)


def generate_world(
    raw_root: str | Path,
    *,
    id_scale: float = 0.02,
    min_ids: int = 12,
    images_per_camera: int = 2,
    height: int = 64,
    width: int = 32,
    seed: int = 0,
    datasets: Sequence[str] | None = None,
    progress: bool = False,
) -> dict:
    """Write the synthetic world's release folders under ``raw_root``.

    ``datasets`` restricts it to some registry names (default: all ten). A
    release folder that already exists is only replaced when
    ``raw_root/synthetic_world.json`` lists it as this generator's output;
    otherwise a ValueError names it, so real data is never overwritten.
    Datasets generated earlier into the same root are kept (and stay listed)
    when the parameters match; with other parameters that is a ValueError.

    Returns the summary also written to ``synthetic_world.json``:
    ``generator``, ``version``, ``complete``, ``parameters`` (the arguments
    and the ``datasets`` present), ``datasets`` (per dataset: ``folder``,
    ``identities``, ``images``, ``cameras``, ``format``, ``counts``,
    ``parser_options``), ``counts`` (``train_ids``, ``train_images``,
    ``query_ids``, ``query_images``, ``gallery_images`` for the fixed-split
    releases; train = train + val, gallery with junk and distractors),
    ``parser_options`` and ``total_images``.
    """
    if isinstance(datasets, str):  # one name, not its letters
        datasets = [datasets]
    names = list(DATASETS if datasets is None else dict.fromkeys(datasets))
    unknown = [n for n in names if n not in RELEASE_DIRS]
    if unknown:
        raise ValueError(f"unknown synthetic dataset(s) {', '.join(map(repr, unknown))}; "
                         f"known: {', '.join(DATASETS)}")
    if not names:
        raise ValueError(f"no dataset to generate; known: {', '.join(DATASETS)}")
    if not id_scale > 0:
        raise ValueError(f"id_scale must be positive, got {id_scale}")
    if min_ids < 4:
        raise ValueError(f"min_ids must be at least 4 (train and test ids), got {min_ids}")
    if images_per_camera < 1:
        raise ValueError(f"images_per_camera must be at least 1, got {images_per_camera}")
    if height < 16 or width < 8:
        raise ValueError(f"images must be at least 16x8 pixels, got {height}x{width}")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")

    root = Path(raw_root)
    world_path = root / WORLD_FILE
    previous = _read_world(world_path)
    if previous is None and world_path.exists():
        raise ValueError(f"refusing to replace {world_path}: it is not this generator's summary")
    own = set(previous.get("datasets", {})) if previous else set()
    for name in names:
        folder = root / RELEASE_DIRS[name]
        if folder.exists() and name not in own:
            raise ValueError(
                f"refusing to write the synthetic {name} into {folder}: it already exists and "
                f"{world_path} does not list it as generated (it may be real data)"
            )
    params = {"id_scale": float(id_scale), "min_ids": int(min_ids),
              "images_per_camera": int(images_per_camera), "height": int(height),
              "width": int(width), "seed": int(seed)}
    kept: dict[str, dict] = {}
    if previous:
        old = {k: v for k, v in previous.get("parameters", {}).items() if k != "datasets"}
        stale = sorted(set(previous.get("datasets", {})) - set(names))
        if stale and (old != params or previous.get("version") != GENERATOR_VERSION):
            raise ValueError(
                f"{world_path} lists {', '.join(stale)} generated with other parameters "
                f"({old}); regenerate them too (datasets=None) or use another raw_root"
            )
        kept = {k: previous["datasets"][k] for k in stale}

    plans = [_plan(name, params) for name in names]
    total = sum(len(p.shots) for p in plans)

    def summary(complete: bool) -> dict:
        entries = dict(kept)
        for p in plans:
            entries[p.name] = {
                "folder": RELEASE_DIRS[p.name],
                "identities": p.num_ids,
                "images": len(p.shots),
                "cameras": NUM_CAMERAS[p.name],
                "format": _STYLES[p.name].ext,
                "counts": p.counts,
                "parser_options": p.parser_options,
            }
        ordered = {k: entries[k] for k in DATASETS if k in entries}
        return {
            "generator": GENERATOR,
            "version": GENERATOR_VERSION,
            "complete": complete,
            "parameters": {**params, "datasets": list(ordered)},
            "datasets": ordered,
            # What the parsers must find where the release fixes the split.
            "counts": {k: e["counts"] for k, e in ordered.items() if e.get("counts")},
            "parser_options": {k: e["parser_options"] for k, e in ordered.items()
                               if e.get("parser_options")},
            "total_images": sum(e["images"] for e in ordered.values()),
        }

    root.mkdir(parents=True, exist_ok=True)
    # Claim the folders before writing, so an interrupted run can be redone.
    _write_world(world_path, summary(complete=False))
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=total, unit="img", desc="synthetic world")
    try:
        for p in plans:
            folder = root / RELEASE_DIRS[p.name]
            if folder.exists():
                shutil.rmtree(folder)  # our own earlier output (checked above)
            if bar is not None:
                bar.set_postfix_str(p.name)
            _write_plan(p, folder, height, width, bar.update if bar is not None else lambda _: None)
    finally:
        if bar is not None:
            bar.close()
    world = summary(complete=True)
    _write_world(world_path, world)
    return world


__all__ = ["DATASETS", "GENERATOR_VERSION", "RELEASE_DIRS", "WORLD_FILE", "generate_world"]
