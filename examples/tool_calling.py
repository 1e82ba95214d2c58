"""Tool calling on the embedded default model, offline: a LangChain tool loop and a LlamaIndex
FunctionAgent, both on the same in-process engine.

SmolLM2-135M rarely decides to call a tool on its own, so the first turn forces a call
(`tool_choice="any"`, `initial_tool_choice="required"`); constrained decoding makes that call
valid for the tool's schema (which tool it picks is the model's choice), and the tool result
goes back to the model for the answer. With the tools still offered, this small model tends to
echo the tool format instead of answering, so the LangChain answer turn offers none.

    python examples/tool_calling.py
"""

from __future__ import annotations

import asyncio

from langchain_core.messages import HumanMessage
from langchain_core.tools import tool
from llama_index.core.agent.workflow import FunctionAgent, ToolCallResult
from llama_index.core.tools import FunctionTool

from langchain_paged import ChatPaged
from llama_index.llms.paged import PagedLLM

WEATHER = {"paris": "sunny, 21 degrees", "oslo": "light snow, -3 degrees"}


def get_weather(city: str) -> str:
    """The current weather in a city."""
    return f"{city}: {WEATHER.get(city.lower(), 'no data')}"


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def langchain_loop(question: str) -> None:
    tools = {t.name: t for t in (tool(get_weather), tool(add))}
    chat = ChatPaged(temperature=0, max_tokens=96)
    messages = [HumanMessage(question)]
    reply = chat.bind_tools(list(tools.values()), tool_choice="any").invoke(messages)
    messages.append(reply)
    for call in reply.tool_calls:
        print(f"  call {call['name']}({call['args']})")
        messages.append(tools[call["name"]].invoke(call))
    answer = chat.invoke(messages)  # the answer turn offers no tools
    print(f"  answer: {answer.content or answer.tool_calls}")


async def llama_index_agent(question: str) -> None:
    agent = FunctionAgent(
        tools=[FunctionTool.from_defaults(get_weather), FunctionTool.from_defaults(add)],
        llm=PagedLLM(temperature=0, max_tokens=96),
        initial_tool_choice="required",
        system_prompt="Answer with the tools' results.",
    )
    handler = agent.run(question)
    async for event in handler.stream_events():
        if isinstance(event, ToolCallResult):
            print(f"  call {event.tool_name}({event.tool_kwargs}) -> {event.tool_output}")
    print(f"  answer: {await handler}")


def main() -> None:
    for question in ("What is the weather in Oslo?", "What is 17 plus 25?"):
        print(f"[LangChain] {question}")
        langchain_loop(question)
        print(f"[LlamaIndex FunctionAgent] {question}")
        asyncio.run(llama_index_agent(question))


if __name__ == "__main__":
    main()
