"""The proving ground: seeded fault injection against real processes (issue 5)."""
