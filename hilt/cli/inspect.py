from __future__ import annotations

from pathlib import Path

from hilt.cli.common import OUTPUT, command
from hilt.cli.output import write_json_option


def cmd_inspect(args) -> int:
    from hilt.quant import read_header

    from hilt.quant.checkpoint import open_shard

    h = read_header(args.dst)
    dst = Path(args.dst)
    for shard in h["shards"]:  # opening checks each shard's length against its header
        with open_shard(dst / shard):
            pass
    size = sum((dst / s).stat().st_size for s in h["shards"])
    c = h["config"]
    t = h["totals"]
    writer = f"hilt {h['tool_version']}" if h["tool_version"] else "transformers' save_pretrained"
    print(f"{dst}: {h['format']} v{h['format_version']} (written by {writer})")
    print(f"source      {h['source']['path']} ({h['source']['format']})")
    if "mixed" in h:  # a format per tensor, chosen under a bits budget
        counts: dict[str, int] = {}
        for e in h["tensors"].values():
            if e["kind"] == "quantized":
                key = f"{e['method']}{e['bits']}@{e['block_size']}"
                counts[key] = counts.get(key, 0) + 1
        print(f"method      mixed per tensor (budget {h['mixed'].get('budget')} bits/weight): "
              + ", ".join(f"{k} x{v}" for k, v in sorted(counts.items())))
    else:
        print(f"method      {c['method']}, {c['bits']} bits, block {c['block_size']}, codebook per {c['codebook']}")
    print(f"tensors     {t['tensors']} ({t['quantized_tensors']} quantized, {t['quantized_weights']:,} weights)")
    print(f"bits/weight {t['bits_per_weight']:.4f} on quantized tensors (codes + scales + codebooks)")
    e = h.get("embeddings")
    if isinstance(e, dict):
        print(f"embeddings  {e['method']}, {e['bits']} bits, block {e['block_size']}")
    elif e:
        print(f"embeddings  int, {e} bits, one scale per row")
    print(f"size        {size / 1e6:.2f} MB in {len(h['shards'])} shard(s)")
    if (dst / "config.json").is_file():
        print("loads with  transformers' AutoModel*.from_pretrained (after `import hilt`)")
    if args.tensors:
        for name, e in h["tensors"].items():
            if e["kind"] == "quantized":
                print(f"  {name:<48} {str(tuple(e['shape'])):>14} {e['bits_per_weight']:7.3f} b/w  err {e['rel_error']:.4f}")
            else:
                print(f"  {name:<48} {str(tuple(e['shape'])):>14} {e['dtype']} (kept)")
    write_json_option(args, {**h, "bytes": size})
    return 0


def register(sub) -> None:
    i = command(sub, "inspect", "show what is in a quantized checkpoint", "hilt inspect out-2bit --tensors", [OUTPUT])
    i.add_argument("dst")
    i.add_argument("--tensors", action="store_true", help="one line per tensor")
    i.set_defaults(func=cmd_inspect)
