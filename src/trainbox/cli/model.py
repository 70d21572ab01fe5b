"""Verbs on a trained model: generate, chat, export."""
from __future__ import annotations

import sys

from trainbox.model.spec import family

# ----------------------------------------------------------------------------- generate


def cmd_generate(args) -> int:
    from trainbox.generate import check_sampling, sample  # heavy: numpy, torch
    from trainbox.model.load import inference_device, load_for_inference  # heavy: numpy, torch

    check_sampling(args.temperature, args.top_k, args.top_p, args.max_tokens)  # before the weights are read
    device = inference_device(args.device)
    model, tokenizer, cfg = load_for_inference(args.path, device)
    if family(cfg.model.family).generate == "spans":  # encoder-decoder: what the model fills in for each sentinel
        from trainbox.data.spans import fill_prompt  # heavy: numpy, torch
        from trainbox.generate import fill_spans  # heavy: numpy, torch
        spans = fill_spans(model, tokenizer, args.prompt, max_tokens=args.max_tokens, temperature=args.temperature,
                           top_k=args.top_k, top_p=args.top_p, seed=args.seed, device=device)
        for k, text in spans:
            print(f"<extra_id_{k}>{text}")
        print(f"--- filled ---\n{fill_prompt(args.prompt, spans)}")
        return 0
    text = sample(model, tokenizer, args.prompt, max_tokens=args.max_tokens, temperature=args.temperature,
                  top_k=args.top_k, top_p=args.top_p, seed=args.seed, device=device)
    print(args.prompt + text)
    return 0


# ----------------------------------------------------------------------------- chat


def cmd_chat(args) -> int:
    """Read user messages from standard input, one a line (a terminal or a pipe; EOF ends), and print each
    answer as it streams; `/reset` clears the history. Only the answers go to stdout."""
    from trainbox.chat import open_chat  # heavy: numpy, torch
    from trainbox.generate import check_sampling  # heavy: numpy, torch
    from trainbox.model.load import inference_device  # heavy: numpy, torch

    check_sampling(args.temperature, args.top_k, args.top_p, args.max_tokens)  # before the weights are read
    device = inference_device(args.device)
    session = open_chat(args.path, device, system=args.system, temperature=args.temperature, top_k=args.top_k,
                        top_p=args.top_p, max_tokens=args.max_tokens, seed=args.seed)
    tty = sys.stdin.isatty()
    end = session.end_text or "end-of-text"
    print(f"chat: {args.path}, template {session.template.name}, answers end at {end}; /reset clears the "
          f"history, {'Ctrl-D' if tty else 'end of input'} ends", file=sys.stderr)
    while True:
        if tty:
            print("> ", end="", flush=True, file=sys.stderr)
        line = sys.stdin.readline()
        if not line:
            return 0
        text = line.rstrip("\n")
        if text.strip() == "/reset":
            session.reset()
            print("(history cleared)", file=sys.stderr)
            continue
        for piece in session.turn(text):
            print(piece, end="", flush=True)
        print(flush=True)
        if session.last.stopped == "max_tokens":
            print(f"(stopped after --max-tokens {args.max_tokens})", file=sys.stderr)


# ----------------------------------------------------------------------------- export


def cmd_export(args) -> int:
    from trainbox.export import export  # heavy: numpy, torch

    for line in export(args.path, args.out, merge=args.merge, force=args.force, format=args.format, dtype=args.dtype,
                       gguf_type=args.gguf_type):
        print(line)
    return 0
