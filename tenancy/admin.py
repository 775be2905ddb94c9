"""Django admin registrations of the tenancy app."""
