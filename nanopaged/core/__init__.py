"""The scheduler's world: who runs each step and which KV blocks hold what
(block tables, the block manager, sequences). Only the scheduler
changes blocks (chapters 01-03, 08-11).
"""
