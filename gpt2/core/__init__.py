"""What every stage shares: params (config), the token file format, atomic outputs, progress, errors."""
