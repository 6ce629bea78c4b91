"""The lean Accelerate trainer: ``accelerate launch -m train --plan PLAN --cache CACHE``."""
