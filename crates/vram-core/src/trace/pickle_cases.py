"""Cases for pickle.rs's differential test: random plain values (shared containers included),
pickled at every protocol, each printed as "PROTOCOL HEX JSON" with JSON the value in a canonical
form the test builds from its own reading too. Usage: python3 pickle_cases.py SEED"""
import json, pickle, random, sys

random.seed(int(sys.argv[1]))
pool = []  # containers made so far, reused to share them

def canon(v):
    if v is None or isinstance(v, bool):
        return v
    if isinstance(v, int):
        return {"int": str(v)} if -2**63 <= v < 2**64 else "big"
    if isinstance(v, float):
        return {"float": v}
    if isinstance(v, str):
        return {"str": v}
    if isinstance(v, bytes):
        return {"bytes": v.hex()}
    if isinstance(v, list):
        return {"list": [canon(x) for x in v]}
    if isinstance(v, tuple):
        return {"tuple": [canon(x) for x in v]}
    if isinstance(v, dict):
        return {"dict": [[canon(k), canon(x)] for k, x in v.items()]}
    raise TypeError(v)

def value(depth, protocol):
    k = random.randrange(10 if depth < 4 else 7)
    if k == 0:
        return random.choice([None, True, False])
    if k == 1:
        return random.choice([0, 1, -1, 255, 256, 65535, 65536, -2**31, 2**31, 2**63 - 1,
                              -2**63, 2**63, 2**64 - 1, 2**64, -2**64, 3**90])
    if k == 2:
        return random.choice([0.0, -1.5, 1e300, 2.5e-10])
    if k == 3:
        return random.choice(["", "alloc", "é\\x\n", "\U0001F600 frames", "a" * 300])
    if k == 4 and protocol >= 3:
        return random.choice([b"", b"\x00\xff", bytes(range(256))])
    if k in (5, 6) and pool:
        return random.choice(pool)
    if k == 7:
        v = [value(depth + 1, protocol) for _ in range(random.randrange(5))]
    elif k == 8:
        v = tuple(value(depth + 1, protocol) for _ in range(random.randrange(6)))
    else:
        v = {random.choice(["action", "addr", "size", "frames", "é"]) + str(i):
             value(depth + 1, protocol) for i in range(random.randrange(5))}
    pool.append(v)
    return v

for protocol in range(6):
    for _ in range(20):
        pool.clear()
        v = value(0, protocol)
        print(protocol, pickle.dumps(v, protocol=protocol).hex(), json.dumps(canon(v)))
