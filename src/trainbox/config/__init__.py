"""RunConfig: the one typed config tree (pydantic v2, extra="forbid").

Flow: recipe name or file (YAML/JSON) -> dict -> dotted `key=value` overrides -> RunConfig -> builders.
Every section owns the settings of one component; a wrong key or type fails here, before any work,
with a message that names the exact dotted key and the closest valid keys.
"""
from trainbox.config.load import (  # noqa: F401
    apply_overrides,
    build_config,
    dump_yaml,
    load_config,
    load_source,
    parse_value,
    public_dict,
    recipe_names,
)
from trainbox.config.model import ModelSection  # noqa: F401
from trainbox.config.schema import (  # noqa: F401
    DataSection,
    DpoSection,
    LoraSection,
    MonitorSection,
    OptimSection,
    QuantSection,
    RunConfig,
    RunSection,
    TrainSection,
)
from trainbox.section import Section  # noqa: F401
