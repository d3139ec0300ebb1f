"""(being written)"""

PLANS: dict = {}
