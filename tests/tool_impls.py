"""A tool implementation for the tool-learning tests (imported by "tests.tool_impls:get_weather")."""


def get_weather(city: str, unit: str = "celsius") -> dict:
    if city == "Atlantis":
        raise ValueError("unknown city")
    return {"city": city, "temperature": 21 if unit == "celsius" else 70, "unit": unit}
