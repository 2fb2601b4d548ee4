"""The ground floor: the config. sections.py types the keys (pydantic models: each key's type, range and
description, and the combinations that cannot work); config.py loads it (defaults <- recipe <- command line,
every problem at once, --help, --print_config). Each option's own start-up check stays in the option's module,
handed over by the trainer (sections.schema's checks).

May import: common.py; nothing else of the repository.
"""
