"""Plot a metric of a titanrl metrics.jsonl as a PNG line chart, with no plotting dependency.

    python scripts/plot_metrics.py outputs/grpo_reverse_debug/metrics.jsonl --out reward.png \
        --keys reward_mean,eval_accuracy

Draws each key (RL steps on x, values on y scaled to the min/max over all keys) on a white
canvas with axes and a light grid; colours in key order: blue, orange, green, red.
"""

import argparse
import json
import struct
import zlib

COLOURS = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40)]


def write_png(path: str, pixels: list[list[tuple[int, int, int]]]) -> None:
    height, width = len(pixels), len(pixels[0])
    raw = b"".join(b"\x00" + bytes(c for px in row for c in px) for row in pixels)

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)

    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
    png += chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b"")
    with open(path, "wb") as f:
        f.write(png)


def _line(pixels, x0, y0, x1, y1, colour, thick=2):
    steps = max(abs(x1 - x0), abs(y1 - y0), 1)
    for i in range(steps + 1):
        x = round(x0 + (x1 - x0) * i / steps)
        y = round(y0 + (y1 - y0) * i / steps)
        for dx in range(thick):
            for dy in range(thick):
                if 0 <= y + dy < len(pixels) and 0 <= x + dx < len(pixels[0]):
                    pixels[y + dy][x + dx] = colour


def plot(series: dict[str, list[tuple[float, float]]], path: str, width: int = 640, height: int = 360) -> None:
    pixels = [[(255, 255, 255)] * width for _ in range(height)]
    margin = 40
    xs = [x for pts in series.values() for x, _ in pts]
    ys = [y for pts in series.values() for _, y in pts]
    x_lo, x_hi = min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1
    y_lo, y_hi = min(0.0, min(ys)), max(ys) if max(ys) > 0 else 1.0

    def to_px(x, y):
        px = margin + (x - x_lo) / (x_hi - x_lo) * (width - 2 * margin)
        py = height - margin - (y - y_lo) / (y_hi - y_lo) * (height - 2 * margin)
        return round(px), round(py)

    for i in range(1, 5):  # light horizontal grid at quarters of the y range
        _, gy = to_px(x_lo, y_lo + (y_hi - y_lo) * i / 4)
        _line(pixels, margin, gy, width - margin, gy, (225, 225, 225), thick=1)
    _line(pixels, margin, height - margin, width - margin, height - margin, (0, 0, 0))
    _line(pixels, margin, margin, margin, height - margin, (0, 0, 0))
    for colour, pts in zip(COLOURS, series.values()):
        for (xa, ya), (xb, yb) in zip(pts, pts[1:]):
            _line(pixels, *to_px(xa, ya), *to_px(xb, yb), colour)
    write_png(path, pixels)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("metrics")
    parser.add_argument("--out", default="metrics.png")
    parser.add_argument("--keys", default="reward_mean,eval_accuracy")
    args = parser.parse_args()
    with open(args.metrics) as f:
        rows = [json.loads(line) for line in f]
    series = {}
    for key in args.keys.split(","):
        pts = [(r["step"], r[key]) for r in rows if r.get("phase") == "rl" and key in r]
        if not pts:
            raise ValueError(f"no RL rows with '{key}' in {args.metrics}")
        series[key] = pts
    plot(series, args.out)
    print(f"wrote {args.out}: " + ", ".join(f"{k} {v[0][1]:.3f} -> {v[-1][1]:.3f}" for k, v in series.items()))


if __name__ == "__main__":
    main()
