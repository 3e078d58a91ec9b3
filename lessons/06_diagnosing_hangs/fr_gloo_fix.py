"""Copy gloo flight-recorder dumps so that torch's analyser can read them.

    python lessons/06_diagnosing_hangs/fr_gloo_fix.py <dump folder> <new folder>
    python -m torch.distributed.flight_recorder.fr_trace <new folder>

Why (torch 2.14.1): each dump's ``pg_config`` says which ranks make up each process group,
keyed by the group's name, and every recorded collective names its group, ("0", "default_pg")
for the default one. The analyser looks a collective's group up by that name:
``_pg_guids[(original_pg_name, first_rank)]`` (flight_recorder/components/builder.py:212),
in a table built from the ``pg_config`` keys (builder.py:108-116). A gloo group records its
``pg_config`` entry when it is constructed (ProcessGroupGloo's constructor,
``record_pg_ranks(std::make_tuple(pg_uid_, pg_desc_), groupRanks())``), and Python names the
group only after that (distributed_c10d.py:669-678 builds it, 2935-2936 name it; NCCL's
options get the name before, at line 711): a gloo dump keys its group by ``''``, with name and
desc ``''``, and the analyser stops with ``KeyError: ('0', 0)``. Every gloo group records under
that same ``''`` key, so a dump of several groups keeps the ranks of one only: this fix handles
the common case, the default group alone, and refuses the rest.
"""

from __future__ import annotations

import argparse
import os
import pickle
import sys


def name_gloo_group(dump: dict) -> dict:
    """The dump with its ``''`` pg_config entry filed under the name its collectives carry.

    A dump without the ``''`` key (NCCL's, or a fixed one) comes back unchanged, and so does
    one without collectives (there is no name to take). ValueError when the collectives name
    several groups: the one ``''`` entry cannot say whose ranks it holds.
    """
    config = dump["pg_config"]
    if "" not in config:
        return dump
    groups = {tuple(entry["process_group"]) for entry in dump["entries"]}
    if not groups:
        return dump
    if len(groups) > 1:
        raise ValueError(f"the collectives name {len(groups)} groups ({sorted(groups)}) and gloo "
                         "recorded the ranks of one, under '': only a dump of one group can be "
                         "fixed; analyse with --pg-filters, or use one group")  # fmt: skip
    ((name, desc),) = groups
    fixed = {key: value for key, value in config.items() if key != ""}
    fixed[name] = {**config[""], "name": name, "desc": desc}
    return {**dump, "pg_config": fixed}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", help="the folder of dumps (<prefix><rank>, one per rank)")
    parser.add_argument("target", help="a new folder for the fixed copies")
    args = parser.parse_args(argv)
    if not os.path.isdir(args.source):
        print(f"fr_gloo_fix: source={args.source!r} is not a folder: pass the folder that "
              "holds the dumps (TORCH_FR_DUMP_TEMP_FILE's folder)", file=sys.stderr)  # fmt: skip
        return 2
    # The files only, listed before the target exists: it may be a folder inside the source.
    source = args.source
    names = sorted(n for n in os.listdir(source) if os.path.isfile(os.path.join(source, n)))
    os.makedirs(args.target, exist_ok=True)
    for name in names:
        with open(os.path.join(source, name), "rb") as f:
            dump = pickle.load(f)
        try:
            dump = name_gloo_group(dump)
        except ValueError as exc:
            print(f"fr_gloo_fix: {name}: {exc}", file=sys.stderr)
            return 1
        with open(os.path.join(args.target, name), "wb") as f:
            pickle.dump(dump, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
