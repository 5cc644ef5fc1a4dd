"""Web layer: routes parse, call one function, render. No tensor code lives here."""
