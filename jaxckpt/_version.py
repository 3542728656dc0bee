"""The version of jaxckpt, recorded in every manifest it writes."""

__version__ = "0.2.0"
