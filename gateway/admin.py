"""Django admin registrations of the gateway app."""
