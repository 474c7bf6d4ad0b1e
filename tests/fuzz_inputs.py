"""Seeded generators of adversarial values (hypothesis is not installed in the venv)."""

import json

KEYS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "ignore_eos")
ODD_STRINGS = [
    "",
    " ",
    "\x00",
    "\ud800",
    "\udfff",
    "\ud83d\ude00",
    "é",
    "e\u0301",
    "\u202e",
    "\ufeff",
    "\n\r\t",
    "a" * 65,
    "a" * 64,
    "x" * 100_000,
    "\u0000" * 10,
    "ﬁ",
    "²",
    "١٢٣",
    "NaN",
    "Infinity",
    "-0",
    "1e308",
    "true",
    "null",
    "[]",
    "{}",
    "\\",
    '"',
    "'",
    "default",
    "standard",
    "critical",
    "warmup",
    "batch",
    "use",
    "bypass",
    "kv-only",
    "refresh",
    "t",
    "a-b.c_d",
    "A" * 64,
    "A" * 65,
    "ten\nant",
    "ℌ",
]
ODD_NUMBERS = [
    0,
    -0.0,
    1,
    -1,
    2,
    64,
    65,
    512,
    513,
    2**31,
    2**63 - 1,
    2**63,
    2**64,
    2**80,
    -(2**80),
    1e308,
    -1e308,
    5e-324,
    1e-5,
    9.99e-6,
    1.0000001,
    0.9999999,
    2.0,
    2.0000001,
    0.5,
    float("nan"),
    float("inf"),
    float("-inf"),
    10**400,
    True,
    False,
    1.5,
    3.0,
    64.0,
]
RAW_NUMBER_TEXTS = [
    "NaN",
    "Infinity",
    "-Infinity",
    "1e400",
    "-1e400",
    "1" * 5000,
    "-0",
    "1E-400",
    "0.0000000000000000000000000001",
    "123456789012345678901234567890",
]


def rand_scalar(rng):
    r = rng.random()
    if r < 0.35:
        return rng.choice(ODD_NUMBERS)
    if r < 0.6:
        return rng.choice(ODD_STRINGS)
    if r < 0.7:
        return rng.choice([None, True, False])
    if r < 0.85:
        return rng.randint(-(10**6), 10**6)
    return rng.uniform(-5, 5)


def rand_value(rng, depth=0):
    r = rng.random()
    if depth > 3 or r < 0.6:
        return rand_scalar(rng)
    if r < 0.8:
        return [rand_value(rng, depth + 1) for _ in range(rng.randint(0, 12))]
    return {
        rng.choice(KEYS + tuple(ODD_STRINGS[:20])): rand_value(rng, depth + 1)
        for _ in range(rng.randint(0, 4))
    }


def rand_stop(rng):
    r = rng.random()
    if r < 0.3:
        return rng.choice(ODD_STRINGS)
    if r < 0.8:
        return [rng.choice(ODD_STRINGS + [1, None, [], {}, ["x"]]) for _ in range(rng.randint(0, 10))]
    return rand_value(rng)


def nested(depth, leaf="1", kind="["):
    if kind == "[":
        return "[" * depth + leaf + "]" * depth
    return '{"a":' * depth + leaf + "}" * depth


def dumps(value, rng):
    """JSON text of `value`, sometimes with raw constants or surrogates the encoder escapes."""
    try:
        text = json.dumps(value, allow_nan=True, ensure_ascii=rng.random() < 0.5)
    except (ValueError, TypeError, RecursionError):
        text = "{}"
    return text


def rand_sampling_json(rng):
    r = rng.random()
    if r < 0.45:
        obj = {}
        for _ in range(rng.randint(0, 8)):
            key = rng.choice(KEYS) if rng.random() < 0.85 else rng.choice(ODD_STRINGS[:25])
            if key == "stop":
                obj[key] = rand_stop(rng)
            elif rng.random() < 0.4:
                obj[key] = rng.choice(ODD_NUMBERS)
            else:
                obj[key] = rand_value(rng)
        return dumps(obj, rng)
    if r < 0.55:  # raw number texts into a key
        return '{"%s": %s}' % (rng.choice(KEYS), rng.choice(RAW_NUMBER_TEXTS))
    if r < 0.62:  # duplicate keys
        k = rng.choice(KEYS)
        return '{"%s": 1, "%s": 2}' % (k, k)
    if r < 0.7:  # deep nesting
        d = rng.choice([10, 500, 900, 990, 1000, 1100, 5000, 100_000])
        return (
            '{"stop": %s}' % nested(d, kind=rng.choice("[{"))
            if rng.random() < 0.5
            else nested(d, kind=rng.choice("[{"))
        )
    if r < 0.78:  # surrogate escapes and control chars
        return rng.choice(
            [
                '{"stop": "\\ud800"}',
                '{"stop": ["\\udfff"]}',
                '{"\\ud800": 1}',
                '{"stop": "\\u0000"}',
                '{"stop": ["a\\ud83d"]}',
                '{"max_tokens": 1}\x00',
                "\ufeff{}",
                '{"stop": "\x01"}',
                '{"stop": "' + "\\ud800" * 64 + '"}',
                '{"' + "k" * 100_000 + '": 1}',
            ]
        )
    if r < 0.86:  # junk text / bytes
        choice = rng.random()
        if choice < 0.3:
            return bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 40)))
        if choice < 0.5:
            return dumps(rand_value(rng), rng).encode("utf-8", "surrogatepass")
        return "".join(chr(rng.randint(0, 0x10FFFF)) for _ in range(rng.randint(0, 30)))
    if r < 0.93:
        return dumps(rand_value(rng), rng)
    return rng.choice([None, "", "   ", "\n", b"", b" ", "null", "[]", "0", '"x"', "{", "}", "{}}", b"\xff"])
