"""What a research change never needs: settings parsing, the data, the run folder, reading runs back
and the statistics library."""
