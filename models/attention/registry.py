"""Name -> attention module registry. Variants register themselves on import."""

from models.registry import Registry

VARIANTS = Registry('attention variant')
register = VARIANTS.register
known = VARIANTS.known
get = VARIANTS.get
