# aerie: prompt datasets -> target responses -> token ids + loss masks -> target hidden states
#        -> draft vocab -> EAGLE-3 drafter -> benchmark against the no-drafter baseline.
# Stages live in rules/<stage>.smk; logic lives in the aerie package; scripts/ are thin entry points.

import os

# The embedded demo is the default; `--configfile FILE` replaces it (it is not merged into it).
if not workflow.overwrite_configfiles:

    configfile: os.path.join(workflow.basedir, "config", "config.yaml")


include: "rules/common.smk"
include: "rules/target.smk"
include: "rules/prompts.smk"
include: "rules/host.smk"
include: "rules/responses.smk"
include: "rules/tokens.smk"
include: "rules/hidden.smk"
include: "rules/drafter.smk"
include: "rules/bench.smk"
include: "rules/card.smk"
include: "rules/report.smk"


rule all:
    default_target: True
    input:
        get_final_outputs(),


onstart:
    refuse_over_budget()


# A preview on a machine without conda stops here, every part of it printed (rules/common.smk).
end_dry_run_without_conda()
