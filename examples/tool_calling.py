"""Tool calling on the embedded default model, offline: a LangChain tool loop and the same loop
with LlamaIndex's tool API, both on one in-process engine.

Each question is asked twice, once through each framework. For "What is 17 plus 25?" the model
picks the tool itself (`tool_choice="any"`: some tool must be called, which one is the model's
choice). SmolLM2-135M is too small to choose reliably between tools by itself (asked about the
weather, it may still pick `add`), so the weather question names its tool (`tool_choice=
"get_weather"`). Either way, constrained decoding makes every call valid for its tool's schema.
The tool's result then goes back to the model for the answer. That turn offers no tools: with
tools still offered, a model this small tends to call again or echo the result's tags.

    python examples/tool_calling.py
"""

from __future__ import annotations

from langchain_core.messages import HumanMessage
from langchain_core.tools import tool
from llama_index.core.llms import ChatMessage
from llama_index.core.tools import FunctionTool

from langchain_paged import ChatPaged
from llama_index.llms.paged import PagedLLM

WEATHER = {"paris": "sunny, 21 degrees", "oslo": "light snow, -3 degrees"}
QUESTIONS = [("What is the weather in Oslo?", "get_weather"), ("What is 17 plus 25?", "any")]


def get_weather(city: str) -> str:
    """The current weather in a city."""
    return f"{city}: {WEATHER.get(city.lower(), 'no data')}"


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def langchain_loop(question: str, tool_choice: str) -> None:
    tools = {t.name: t for t in (tool(get_weather), tool(add))}
    chat = ChatPaged(temperature=0, max_tokens=64)
    messages = [HumanMessage(question)]
    reply = chat.bind_tools(list(tools.values()), tool_choice=tool_choice).invoke(messages)
    messages.append(reply)
    for call in reply.tool_calls:
        result = tools[call["name"]].invoke(call)
        print(f"  call {call['name']}({call['args']}) -> {result.content}")
        messages.append(result)
    print(f"  answer: {chat.invoke(messages).content}")


def llama_index_loop(question: str, tool_choice: str) -> None:
    tools = {t.metadata.name: t for t in map(FunctionTool.from_defaults, (get_weather, add))}
    llm = PagedLLM(temperature=0, max_tokens=64)
    messages = [ChatMessage(role="user", content=question)]
    reply = llm.chat_with_tools(
        list(tools.values()), chat_history=messages, tool_choice=tool_choice
    )
    messages.append(reply.message)
    for call in llm.get_tool_calls_from_response(reply):
        result = tools[call.tool_name](**call.tool_kwargs)
        print(f"  call {call.tool_name}({call.tool_kwargs}) -> {result.content}")
        messages.append(
            ChatMessage(
                role="tool",
                content=result.content,
                additional_kwargs={"tool_call_id": call.tool_id, "name": call.tool_name},
            )
        )
    print(f"  answer: {llm.chat(messages).message.content}")


def main() -> None:
    for question, tool_choice in QUESTIONS:
        print(f"[LangChain, tool_choice={tool_choice!r}] {question}")
        langchain_loop(question, tool_choice)
        print(f"[LlamaIndex, tool_choice={tool_choice!r}] {question}")
        llama_index_loop(question, tool_choice)


if __name__ == "__main__":
    main()
