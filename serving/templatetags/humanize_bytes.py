from django import template

register = template.Library()


@register.filter
def gib(value) -> str:
    """Bytes as GiB with two decimals; an absent figure stays absent."""
    if value is None or value == "":
        return "—"
    return f"{int(value) / 2**30:,.2f} GiB"
