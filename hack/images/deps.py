"""Print the dependencies of the given pyproject.toml files, one per line, leaving out the
kubeshard parts themselves and any name given with --without (image build stages install
dependencies in a layer of their own, so a change of the sources alone rebuilds in
seconds)."""

import sys
import tomllib

args = sys.argv[1:]
without = {"kubeshard-proto", "kubeshard-shard", "kubeshard-router", "kubeshard-operator"}
if "--without" in args:
    i = args.index("--without")
    without |= set(args[i + 1].split(","))
    del args[i:i + 2]
for path in args:
    with open(path, "rb") as f:
        for dep in tomllib.load(f)["project"].get("dependencies", []):
            name = dep.split(";")[0].strip()
            bare = name
            for sep in "<>=!~[ ":
                bare = bare.split(sep)[0]
            if bare.lower().replace("_", "-") not in without:
                print(name)
